// Runs a MicroPython script in the 32-bit WebAssembly port under Node:
//   node tools/wasm/run.mjs [--heap BYTES] SCRIPT [FILE...]
// Each FILE is copied into the port's in-memory filesystem under /lib
// (the port has no access to the host's files), then SCRIPT runs (the
// port's sys has no argv). Its output goes to stdout; an uncaught Python
// exception is printed on stderr and the exit status is 1.
import { loadMicroPython } from "@micropython/micropython-webassembly-pyscript";
import fs from "node:fs";
import path from "node:path";

const args = process.argv.slice(2);
let heap = 64 * 1024 * 1024;
if (args[0] === "--heap") {
  heap = parseInt(args[1], 10);
  args.splice(0, 2);
}
const [script, ...files] = args;
if (!script) {
  process.stderr.write("usage: node run.mjs [--heap BYTES] SCRIPT [FILE...]\n");
  process.exit(2);
}
const mp = await loadMicroPython({
  heapsize: heap,
  stdout: (line) => process.stdout.write(line + "\n"),
  linebuffer: true,
});
mp.FS.mkdir("/lib");
for (const f of files) {
  mp.FS.writeFile("/lib/" + path.basename(f), fs.readFileSync(f));
}
try {
  mp.runPython(fs.readFileSync(script, "utf8"));
  // A script that defines _step() and _DONE is resumed once per call (a
  // collection at the start of a call finds no stale pointer to garbage on
  // the C stack; see tools/wasm/costs.py). Bounded: 100,000 steps.
  if (mp.globals.get("_step") !== undefined) {
    for (let i = 0; i < 100000 && !mp.globals.get("_DONE"); i++) {
      mp.runPython("_step()");
    }
  }
} catch (e) {
  process.stderr.write(String(e.message || e) + "\n");
  process.exit(1);
}
