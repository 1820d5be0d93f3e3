'use strict';
// Shared by generate.js and stream_infer.js: the repository's .proto files loaded at runtime with
// proto-loader (no generated code), flag checks, bearer tokens, gRPC status names and exit codes.

const fs = require('fs');
const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

/** The repository root: the .proto files are found from here, whatever the working directory. */
const REPO = path.resolve(__dirname, '..', '..');
/** warmserve's contracts (import paths such as "warmserve/v1/generation.proto"). */
const PROTOS = path.join(REPO, 'protos');
/** Triton's vendored KServe v2 contracts (grpc_service.proto imports "model_config.proto"). */
const TRITON_PROTOS = path.join(REPO, 'third_party', 'triton');

/** Exit codes, as warmserve's own CLI: 2 bad usage or input, 1 a failed call, 130 Ctrl-C. */
const EXIT_USAGE = 2;
const EXIT_FAILED = 1;
const EXIT_INTERRUPTED = 130;

/**
 * Load `file` (relative to `includeDir`) and return the grpc-js package object. Field names stay
 * as written in the .proto (snake_case), enums are their names, 64-bit integers strings.
 */
function loadProto(file, includeDir) {
  const full = path.join(includeDir, file);
  if (!fs.existsSync(full)) {
    throw new UsageError(`${full} does not exist (is this a warmserve checkout?)`);
  }
  const definition = protoLoader.loadSync(file, {
    keepCase: true, longs: String, enums: String, defaults: true, oneofs: true, includeDirs: [includeDir],
  });
  return grpc.loadPackageDefinition(definition);
}

/** Bad flags or input, found before dialling: exit 2. */
class UsageError extends Error {}

/** The name of a gRPC status code ("INVALID_ARGUMENT"), or its number when unknown. */
function statusName(code) {
  const name = Object.keys(grpc.status).find((k) => grpc.status[k] === code);
  return name || String(code);
}

/** The exit code for a failed call: 2 for INVALID_ARGUMENT (bad input, as warmserve's CLI), else 1. */
function exitCodeFor(err) {
  return err.code === grpc.status.INVALID_ARGUMENT ? EXIT_USAGE : EXIT_FAILED;
}

function parseIntFlag(name, text, min, max) {
  if (text === undefined) return undefined;
  if (!/^-?\d+$/.test(text.trim())) throw new UsageError(`--${name} must be an integer, got ${JSON.stringify(text)}`);
  const value = BigInt(text.trim());
  if (value < BigInt(min) || value > BigInt(max)) {
    throw new UsageError(`--${name} must be in [${min}, ${max}], got ${text}`);
  }
  return value;
}

/** An int32 flag in [min, max] as a Number (undefined when not given). */
function intFlag(name, text, min, max = 2 ** 31 - 1) {
  const value = parseIntFlag(name, text, min, max);
  return value === undefined ? undefined : Number(value);
}

/** A uint64 flag as a decimal string (exact beyond 2^53; undefined when not given). */
function uint64Flag(name, text) {
  const value = parseIntFlag(name, text, 0, (2n ** 64n - 1n).toString());
  return value === undefined ? undefined : value.toString();
}

/** A float flag >= min (undefined when not given). */
function floatFlag(name, text, min = 0) {
  if (text === undefined) return undefined;
  const value = Number(text);
  if (text.trim() === '' || !Number.isFinite(value) || value < min) {
    throw new UsageError(`--${name} must be a finite number >= ${min}, got ${JSON.stringify(text)}`);
  }
  return value;
}

/** Call metadata with `authorization: Bearer <token>` read from `tokenFile` (first line), if given. */
function callMetadata(tokenFile) {
  const metadata = new grpc.Metadata();
  if (tokenFile !== undefined) {
    let token;
    try {
      token = (fs.readFileSync(tokenFile, 'utf8').split(/\r?\n/)[0] || '').trim();
    } catch (e) {
      throw new UsageError(`cannot read token file ${tokenFile}: ${e.message}`);
    }
    if (!token) throw new UsageError(`token file ${tokenFile} is empty`);
    metadata.set('authorization', `Bearer ${token}`);
  }
  return metadata;
}

/** `host:port` with a port in [1, 65535] (IPv6 hosts in brackets), else a UsageError. */
function checkAddress(addr) {
  const m = /^(\[[^\]]+\]|[^:[\]]+):(\d+)$/.exec(addr || '');
  if (!m || Number(m[2]) < 1 || Number(m[2]) > 65535) {
    throw new UsageError(`--addr must be host:port, got ${JSON.stringify(addr)}`);
  }
  return addr;
}

/** A deadline `seconds` from now (grpc-js takes a Date). */
function deadlineIn(seconds) {
  return new Date(Date.now() + seconds * 1000);
}

/**
 * Cancel `call` on the first Ctrl-C (SIGINT); a second one exits at once. Returns a function
 * telling whether the user cancelled.
 */
function cancelOnSigint(call) {
  let cancelled = false;
  process.on('SIGINT', () => {
    if (cancelled) process.exit(EXIT_INTERRUPTED);
    cancelled = true;
    call.cancel();
  });
  return () => cancelled;
}

/** Report a failed call on stderr and set the exit code ("prog: INVALID_ARGUMENT: details"). */
function reportCallError(prog, err, interrupted) {
  if (interrupted && err.code === grpc.status.CANCELLED) {
    process.stderr.write(`${prog}: cancelled (Ctrl-C)\n`);
    process.exitCode = EXIT_INTERRUPTED;
    return;
  }
  process.stderr.write(`${prog}: ${statusName(err.code)}: ${err.details || err.message}\n`);
  process.exitCode = exitCodeFor(err);
}

/** Run `main`, turning a UsageError into "prog: error: ..." and exit 2. */
function runMain(prog, main) {
  try {
    main();
  } catch (e) {
    if (e instanceof UsageError || (e && e.code && String(e.code).startsWith('ERR_PARSE_ARGS'))) {
      process.stderr.write(`${prog}: error: ${e.message}\n`);
      process.exitCode = EXIT_USAGE;
      return;
    }
    throw e;
  }
}

module.exports = {
  REPO, PROTOS, TRITON_PROTOS, EXIT_USAGE, EXIT_FAILED, EXIT_INTERRUPTED, UsageError, loadProto, statusName,
  exitCodeFor, intFlag, uint64Flag, floatFlag, callMetadata, checkAddress, deadlineIn, cancelOnSigint,
  reportCallError, runMain, grpc,
};
