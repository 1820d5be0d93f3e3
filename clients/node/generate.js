#!/usr/bin/env node
'use strict';
// Stream a completion from warmserve's router (or a runner: the same contract) through
// warmserve.v1.Generation/Generate, loading protos/warmserve/v1/generation.proto at runtime.
//
//   node clients/node/generate.js --prompt "w5 w6 w7" --max-tokens 8
//   node clients/node/generate.js --chat --prompt "Hello!" --json
//   node clients/node/generate.js --prompt "A date:" --regex '[0-9]{4}-[0-9]{2}-[0-9]{2}'
//
// Default output: the text deltas on stdout as they arrive, then a newline, and a summary on
// stderr; with --n above 1, each choice's text once it is done, as "[index] text" lines in index
// order, and one summary line per choice. --json: each streamed message as one JSON object per
// line (field names as in the .proto, enums by name; `index` names the choice). A failed call
// prints "generate.js: STATUS: details" on stderr and exits 2 for INVALID_ARGUMENT, 1 otherwise;
// Ctrl-C cancels the call (exit 130).

const fs = require('fs');
const { parseArgs } = require('util');
const {
  PROTOS, UsageError, loadProto, intFlag, uint64Flag, floatFlag, callMetadata, checkAddress, deadlineIn,
  cancelOnSigint, reportCallError, runMain, grpc,
} = require('./common');

const PROG = 'generate.js';

const USAGE = `usage: node clients/node/generate.js [--addr HOST:PORT] (--prompt TEXT | TEXT) [--chat]
                  [--max-tokens N] [--temperature T] [--seed S] [--n N] [--timeout SECONDS] [--json]
                  [--token-file FILE]
                  [--json-schema FILE|JSON | --json-object | --regex RE | --choice TEXT... | --grammar FILE]

  --addr HOST:PORT   the router (or a runner); default 127.0.0.1:50050
  --prompt TEXT      the prompt (or give it as the only positional argument)
  --chat             send the prompt as one user message of a chat (the model's chat template);
                     without it the prompt is raw text, tokenized without a template
  --max-tokens N     tokens to generate (> 0); left out: the model's default
  --temperature T    >= 0, 0 = greedy; left out: the model's default
  --seed S           per-request sampling seed, in [0, 2^64); choice i samples with S + i
  --n N              choices to generate for the prompt (>= 1); above 1 each is printed once done,
                     as "[index] text"
  --timeout SECONDS  deadline of the call; default 120
  --json             print each streamed message as one JSON object per line
  --token-file FILE  send the bearer token in FILE (first line)

Structured output (SamplingParams.structured; at most one; the output follows it and ends when it
is complete; an invalid one is refused with INVALID_ARGUMENT naming the problem):
  --json-schema FILE|JSON  a JSON Schema: inline JSON (text starting with "{") or a file holding it
  --json-object            any JSON object
  --regex RE               a regular expression the whole output matches
  --choice TEXT            exactly one of the strings; repeat the flag once per string
  --grammar FILE           a context-free grammar in FILE: GBNF (llama.cpp) or Lark (llguidance)
`;

/** The flags that set SamplingParams.structured, for the "at most one" message. */
const STRUCTURED_FLAGS = ['json-schema', 'json-object', 'regex', 'choice', 'grammar'];

function readFlagFile(flag, file) {
  try {
    return fs.readFileSync(file, 'utf8');
  } catch (e) {
    throw new UsageError(`--${flag}: cannot read ${file}: ${e.message}`);
  }
}

/**
 * The StructuredOutput message of the structured-output flags (undefined when none is given).
 * The schema is checked to be a JSON object here (so a typo fails before dialling) and sent as
 * given; the server compiles it and refuses one it cannot follow.
 */
function buildStructured(values) {
  const given = STRUCTURED_FLAGS.filter((f) => (f === 'json-object' ? values[f] : values[f] !== undefined));
  if (given.length > 1) {
    throw new UsageError(`give at most one structured-output flag, got ${given.map((f) => `--${f}`).join(', ')}`);
  }
  if (!given.length) return undefined;
  const flag = given[0];
  if (flag === 'json-schema') {
    const arg = values['json-schema'];
    const text = /^\s*[{[]/.test(arg) ? arg : readFlagFile(flag, arg); // inline JSON, else a file
    let schema;
    try {
      schema = JSON.parse(text);
    } catch (e) {
      throw new UsageError(`--json-schema is not valid JSON: ${e.message}`);
    }
    if (schema === null || typeof schema !== 'object' || Array.isArray(schema)) {
      throw new UsageError('--json-schema must be a JSON object (a JSON Schema)');
    }
    return { json_schema: text };
  }
  if (flag === 'json-object') return { json_object: true };
  if (flag === 'regex') {
    if (!values.regex) throw new UsageError('--regex must not be empty');
    return { regex: values.regex };
  }
  if (flag === 'choice') {
    if (values.choice.some((c) => c === '')) throw new UsageError('--choice must not be empty');
    return { choice: { choices: values.choice } };
  }
  const grammar = readFlagFile(flag, values.grammar);
  if (!grammar.trim()) throw new UsageError(`--grammar: ${values.grammar} is empty`);
  return { grammar };
}

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
  const n = intFlag('n', values.n, 1);
  const structured = buildStructured(values);
  if (maxTokens !== undefined) sampling.max_tokens = maxTokens;
  if (temperature !== undefined) sampling.temperature = temperature;
  if (seed !== undefined) sampling.seed = seed;
  if (n !== undefined) sampling.n = n;
  if (structured !== undefined) sampling.structured = structured;
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
      n: { type: 'string' },
      'json-schema': { type: 'string' },
      'json-object': { type: 'boolean', default: false },
      regex: { type: 'string' },
      choice: { type: 'string', multiple: true },
      grammar: { type: 'string' },
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

  const choices = request.sampling.n || 1;
  const texts = new Map(); // index -> text so far, when choices > 1 (printed once the call ends)
  const finals = new Map(); // index -> that choice's last message (the one with usage)
  let wrote = false;
  let failed = false;
  call.on('data', (msg) => {
    const index = msg.index || 0;
    if (values.json) {
      process.stdout.write(`${JSON.stringify(msg)}\n`);
    } else if (choices === 1) {
      if (msg.text) {
        process.stdout.write(msg.text);
        wrote = true;
      }
    } else {
      texts.set(index, (texts.get(index) || '') + msg.text);
    }
    if (msg.usage) finals.set(index, msg);
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
    if (!values.json && choices === 1) process.stdout.write('\n');
    const missing = [...Array(choices).keys()].filter((i) => !finals.has(i));
    if (missing.length) {
      const which = choices === 1 ? '' : ` for choice ${missing.join(', ')}`;
      process.stderr.write(`${PROG}: the stream ended without a final message${which}\n`);
      process.exitCode = 1;
      return;
    }
    if (values.json) return;
    for (let i = 0; i < choices; i += 1) {
      const last = finals.get(i);
      const choice = choices === 1 ? '' : ` choice ${i}:`;
      if (choices > 1) process.stdout.write(`[${i}] ${texts.get(i) || ''}\n`);
      process.stderr.write(`[${last.runner_id || '?'}]${choice} ${last.usage.completion_tokens} tokens, prompt `
        + `${last.usage.prompt_tokens} tokens, finish ${shortReason(last.finish_reason)}\n`);
    }
  });
}

runMain(PROG, main);
