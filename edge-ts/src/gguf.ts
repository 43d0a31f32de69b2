// A GGUF file's metadata read from disk without loading the model (ggufmeta.ts parses it).

import { closeSync, openSync, readSync } from "node:fs";
import { GgufValue, parseGgufMetadata } from "./ggufmeta.js";

export type { GgufValue } from "./ggufmeta.js";

/** Every metadata key of the GGUF file at `path`, with its value. */
export function readGgufMetadata(path: string): Map<string, GgufValue> {
  const fd = openSync(path, "r");
  try {
    return parseGgufMetadata((offset, n) => {
      const chunk = new Uint8Array(n);
      const got = readSync(fd, chunk, 0, n, offset);
      return chunk.subarray(0, got);
    }, path);
  } finally {
    closeSync(fd);
  }
}
