#!/usr/bin/env node
'use strict';
// Stream a completion through the router's KServe v2 door: inference.GRPCInferenceService/
// ModelStreamInfer, with the tensors of Triton's vLLM backend (text_input BYTES, stream BOOL true,
// sampling_parameters BYTES JSON), loading Triton's grpc_service.proto from third_party/triton/
// at runtime.
//
//   node clients/node/stream_infer.js --prompt "w5 w6 w7" --max-tokens 8 --temperature 0
//
// Default output: the text_output deltas on stdout as they arrive, then a newline. --json: one
// JSON object per response ({"id", "model_name", "text_output", "final"}). The request asks for
// Triton's empty final response (parameter triton_enable_empty_final_response), so the end of the
// request is known; the stream is then half-closed. An error (an RPC status, or a response's
// error_message) goes to stderr: exit 2 for INVALID_ARGUMENT, 1 otherwise; Ctrl-C cancels (130).

const { parseArgs } = require('util');
const {
  TRITON_PROTOS, UsageError, loadProto, intFlag, uint64Flag, floatFlag, callMetadata, checkAddress, deadlineIn,
  cancelOnSigint, reportCallError, runMain, statusName, grpc, EXIT_FAILED, EXIT_USAGE,
} = require('./common');

const PROG = 'stream_infer.js';

const USAGE = `usage: node clients/node/stream_infer.js [--addr HOST:PORT] [--model NAME] (--prompt TEXT | TEXT)
                  [--max-tokens N] [--temperature T] [--seed S] [--timeout SECONDS] [--json]
                  [--token-file FILE]

  --addr HOST:PORT   the router; default 127.0.0.1:50050
  --model NAME       the model name (KServe model_name); left out: the only model the server's
                     RepositoryIndex lists as ready
  --prompt TEXT      the prompt, raw text (or give it as the only positional argument)
  --max-tokens N     sampling_parameters max_tokens (> 0)
  --temperature T    sampling_parameters temperature (>= 0, 0 = greedy)
  --seed S           sampling_parameters seed, in [0, 2^64)
  --timeout SECONDS  deadline of the call; default 120
  --json             print each response as one JSON object per line
  --token-file FILE  send the bearer token in FILE (first line)
`;

/** One BYTES element in KServe's raw form: a 4-byte little-endian length, then the bytes. */
function bytesElement(text) {
  const data = Buffer.from(text, 'utf8');
  const length = Buffer.alloc(4);
  length.writeUInt32LE(data.length, 0);
  return Buffer.concat([length, data]);
}

/** The elements of a raw BYTES tensor (each length-prefixed), as UTF-8 strings. */
function decodeBytesTensor(raw) {
  const out = [];
  let at = 0;
  while (at < raw.length) {
    if (at + 4 > raw.length) throw new Error('a BYTES tensor ends inside an element length');
    const n = raw.readUInt32LE(at);
    if (at + 4 + n > raw.length) throw new Error('a BYTES tensor element runs past the end');
    out.push(raw.subarray(at + 4, at + 4 + n).toString('utf8'));
    at += 4 + n;
  }
  return out;
}

/** The text_output elements of a ModelInferResponse, from raw_output_contents or contents. */
function textOutput(response) {
  const outputs = response.outputs || [];
  const index = outputs.findIndex((o) => o.name === 'text_output');
  if (index < 0) return null;
  const raw = response.raw_output_contents || [];
  if (raw.length) {
    if (index >= raw.length) throw new Error('raw_output_contents has no entry for text_output');
    return decodeBytesTensor(Buffer.from(raw[index]));
  }
  const contents = outputs[index].contents;
  return ((contents && contents.bytes_contents) || []).map((b) => Buffer.from(b).toString('utf8'));
}

/** Whether a response is the last one of its request (Triton's triton_final_response). */
function isFinal(response) {
  const p = response.parameters && response.parameters.triton_final_response;
  return Boolean(p && p.bool_param);
}

/** vLLM's sampling_parameters JSON; the seed written as its exact decimal (beyond 2^53 too). */
function samplingJson(sampling, seed) {
  const text = JSON.stringify(sampling);
  if (seed === undefined) return text;
  return `${text.slice(0, -1)}${text === '{}' ? '' : ','}"seed":${seed}}`;
}

/** The ModelInferRequest of `prompt` and the sampling_parameters JSON text, for `model`. */
function buildRequest(model, prompt, sampling) {
  return {
    model_name: model,
    id: '',
    parameters: { triton_enable_empty_final_response: { bool_param: true } },
    inputs: [
      { name: 'text_input', datatype: 'BYTES', shape: [1] },
      { name: 'stream', datatype: 'BOOL', shape: [1] },
      { name: 'sampling_parameters', datatype: 'BYTES', shape: [1] },
    ],
    outputs: [{ name: 'text_output' }],
    raw_input_contents: [bytesElement(prompt), Buffer.from([1]), bytesElement(sampling)],
  };
}

/** Ask the server's RepositoryIndex for its one ready model; calls back with (error, name). */
function onlyReadyModel(client, metadata, deadline, callback) {
  client.RepositoryIndex({ ready: true }, metadata, { deadline }, (err, index) => {
    if (err) {
      callback(new Error(`RepositoryIndex failed (${statusName(err.code)}: ${err.details}); give --model NAME`));
      return;
    }
    const names = [...new Set((index.models || []).map((m) => m.name))];
    if (names.length !== 1) {
      callback(new Error(`the server lists ${names.length} ready models (${names.join(', ') || 'none'}); `
        + 'give --model NAME'));
      return;
    }
    callback(null, names[0]);
  });
}

function main() {
  const { values, positionals } = parseArgs({
    allowPositionals: true,
    options: {
      addr: { type: 'string', default: '127.0.0.1:50050' },
      model: { type: 'string' },
      prompt: { type: 'string' },
      'max-tokens': { type: 'string' },
      temperature: { type: 'string' },
      seed: { type: 'string' },
      timeout: { type: 'string', default: '120' },
      json: { type: 'boolean', default: false },
      'token-file': { type: 'string' },
      help: { type: 'boolean', short: 'h', default: false },
    },
  });
  if (values.help) {
    process.stdout.write(USAGE);
    return;
  }
  if (positionals.length > 1) throw new UsageError(`one prompt expected, got ${positionals.length} arguments`);
  if (values.prompt !== undefined && positionals.length) {
    throw new UsageError('give the prompt either with --prompt or as an argument, not both');
  }
  const prompt = values.prompt !== undefined ? values.prompt : positionals[0];
  if (prompt === undefined) throw new UsageError('a prompt is required (--prompt TEXT)');
  if (values.model === '') throw new UsageError('--model is empty');
  const sampling = {};
  const maxTokens = intFlag('max-tokens', values['max-tokens'], 1);
  const temperature = floatFlag('temperature', values.temperature);
  const seed = uint64Flag('seed', values.seed);
  if (maxTokens !== undefined) sampling.max_tokens = maxTokens;
  if (temperature !== undefined) sampling.temperature = temperature;
  const addr = checkAddress(values.addr);
  const timeout = floatFlag('timeout', values.timeout);
  if (timeout === 0) throw new UsageError('--timeout must be > 0');
  const metadata = callMetadata(values['token-file']);
  const deadline = deadlineIn(timeout);

  const proto = loadProto('grpc_service.proto', TRITON_PROTOS);
  const client = new proto.inference.GRPCInferenceService(addr, grpc.credentials.createInsecure());
  const parameters = samplingJson(sampling, seed);
  const start = (model) => stream(client, metadata, deadline, buildRequest(model, prompt, parameters), values.json);
  if (values.model !== undefined) {
    start(values.model);
    return;
  }
  onlyReadyModel(client, metadata, deadline, (err, model) => {
    if (err) {
      process.stderr.write(`${PROG}: error: ${err.message}\n`);
      process.exitCode = EXIT_USAGE;
      client.close();
      return;
    }
    start(model);
  });
}

function stream(client, metadata, deadline, request, json) {
  const call = client.ModelStreamInfer(metadata, { deadline });
  const interrupted = cancelOnSigint(call);
  let wrote = false;
  let failed = false;
  let final = false;
  const fail = (message) => {
    failed = true;
    if (wrote) process.stdout.write('\n');
    process.stderr.write(`${PROG}: ${message}\n`);
    process.exitCode = EXIT_FAILED;
    call.cancel();
    client.close();
  };
  call.on('data', (msg) => {
    if (failed) return;
    if (msg.error_message) {
      fail(msg.error_message);
      return;
    }
    const response = msg.infer_response || {};
    let texts;
    try {
      texts = textOutput(response) || [];
    } catch (e) {
      fail(`a malformed response: ${e.message}`);
      return;
    }
    final = isFinal(response);
    const text = texts.join('');
    if (json) {
      process.stdout.write(`${JSON.stringify({
        id: response.id, model_name: response.model_name, text_output: text, final,
      })}\n`);
    } else if (text) {
      process.stdout.write(text);
      wrote = true;
    }
    if (final) call.end(); // the request is done: half-close, the server then ends the stream
  });
  call.on('error', (err) => {
    if (failed) return; // already reported (our own cancel after an error_message)
    failed = true;
    if (wrote) process.stdout.write('\n');
    reportCallError(PROG, err, interrupted());
    client.close();
  });
  call.on('end', () => {
    if (failed) return;
    client.close();
    if (!json) process.stdout.write('\n');
    if (!final) {
      process.stderr.write(`${PROG}: the stream ended before the request's final response\n`);
      process.exitCode = EXIT_FAILED;
    }
  });
  call.write(request);
}

runMain(PROG, main);
