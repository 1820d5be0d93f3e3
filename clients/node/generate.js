#!/usr/bin/env node
'use strict';
// Stream a completion from warmserve's router (or a runner: the same contract) through
// warmserve.v1.Generation/Generate, loading protos/warmserve/v1/generation.proto at runtime.
//
//   node clients/node/generate.js --prompt "w5 w6 w7" --max-tokens 8
//   node clients/node/generate.js --chat --prompt "Hello!" --json
//
// Default output: the text deltas on stdout as they arrive, then a newline, and a summary on
// stderr. --json: each streamed message as one JSON object per line (field names as in the
// .proto, enums by name). A failed call prints "generate.js: STATUS: details" on stderr and exits
// 2 for INVALID_ARGUMENT, 1 otherwise; Ctrl-C cancels the call (exit 130).

const { parseArgs } = require('util');
const {
  PROTOS, UsageError, loadProto, intFlag, uint64Flag, floatFlag, callMetadata, checkAddress, deadlineIn,
  cancelOnSigint, reportCallError, runMain, grpc,
} = require('./common');

const PROG = 'generate.js';

const USAGE = `usage: node clients/node/generate.js [--addr HOST:PORT] (--prompt TEXT | TEXT) [--chat]
                  [--max-tokens N] [--temperature T] [--seed S] [--timeout SECONDS] [--json]
                  [--token-file FILE]

  --addr HOST:PORT   the router (or a runner); default 127.0.0.1:50050
  --prompt TEXT      the prompt (or give it as the only positional argument)
  --chat             send the prompt as one user message of a chat (the model's chat template);
                     without it the prompt is raw text, tokenized without a template
  --max-tokens N     tokens to generate (> 0); left out: the model's default
  --temperature T    >= 0, 0 = greedy; left out: the model's default
  --seed S           per-request sampling seed, in [0, 2^64)
  --timeout SECONDS  deadline of the call; default 120
  --json             print each streamed message as one JSON object per line
  --token-file FILE  send the bearer token in FILE (first line)
`;

/** The GenerateRequest of the parsed flags (plain object, snake_case fields). */
function buildRequest(values, positionals) {
  if (positionals.length > 1) throw new UsageError(`one prompt expected, got ${positionals.length} arguments`);
  if (values.prompt !== undefined && positionals.length) {
    throw new UsageError('give the prompt either with --prompt or as an argument, not both');
  }
  const prompt = values.prompt !== undefined ? values.prompt : positionals[0];
  if (prompt === undefined) throw new UsageError('a prompt is required (--prompt TEXT)');
  const sampling = {};
  const maxTokens = intFlag('max-tokens', values['max-tokens'], 1);
  const temperature = floatFlag('temperature', values.temperature);
  const seed = uint64Flag('seed', values.seed);
  if (maxTokens !== undefined) sampling.max_tokens = maxTokens;
  if (temperature !== undefined) sampling.temperature = temperature;
  if (seed !== undefined) sampling.seed = seed;
  const request = { sampling };
  if (values.chat) request.chat = { messages: [{ role: 'user', content: prompt }] };
  else request.text = prompt;
  return request;
}

/** "LENGTH" of "FINISH_REASON_LENGTH" (or of an older "LENGTH"). */
function shortReason(name) {
  return String(name).replace(/^FINISH_REASON_/, '');
}

function main() {
  const { values, positionals } = parseArgs({
    allowPositionals: true,
    options: {
      addr: { type: 'string', default: '127.0.0.1:50050' },
      prompt: { type: 'string' },
      chat: { type: 'boolean', default: false },
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
  const request = buildRequest(values, positionals);
  const addr = checkAddress(values.addr);
  const timeout = floatFlag('timeout', values.timeout);
  if (timeout === 0) throw new UsageError('--timeout must be > 0');
  const metadata = callMetadata(values['token-file']);

  const proto = loadProto('warmserve/v1/generation.proto', PROTOS);
  const client = new proto.warmserve.v1.Generation(addr, grpc.credentials.createInsecure());
  const call = client.Generate(request, metadata, { deadline: deadlineIn(timeout) });
  const interrupted = cancelOnSigint(call);

  let last = null;
  let wrote = false;
  let failed = false;
  call.on('data', (msg) => {
    if (values.json) {
      process.stdout.write(`${JSON.stringify(msg)}\n`);
    } else if (msg.text) {
      process.stdout.write(msg.text);
      wrote = true;
    }
    last = msg;
  });
  call.on('error', (err) => {
    failed = true;
    if (wrote) process.stdout.write('\n'); // end the streamed line before the error goes to stderr
    reportCallError(PROG, err, interrupted());
    client.close();
  });
  call.on('end', () => {
    if (failed) return;
    client.close();
    if (!values.json) process.stdout.write('\n');
    if (!last || !last.usage) {
      process.stderr.write(`${PROG}: the stream ended without a final message\n`);
      process.exitCode = 1;
      return;
    }
    if (!values.json) {
      process.stderr.write(`[${last.runner_id || '?'}] ${last.usage.completion_tokens} tokens, prompt `
        + `${last.usage.prompt_tokens} tokens, finish ${shortReason(last.finish_reason)}\n`);
    }
  });
}

runMain(PROG, main);
