"""Kills processes that are saving a context, at random moments, and reports what a reader then finds.

Run as ``python kill_writer.py FOLDER TRIALS SEED`` with two context files ``a.safetensors`` and ``b.safetensors``
in FOLDER. For each trial a forked child writes them in turn to ``FOLDER/store/<key>.safetensors`` (the store's
publishing path, ``context_file.write_atomically``) until it is killed with SIGKILL after a random delay (up to
4 writes' time); the parent then reads the entry back (format and checksum verified). Prints one JSON line: per
trial, "a", "b" (a whole file of either), "none" (no file yet) or the error a partial entry gave. A writer that
writes the entry in place, in 64 KB pieces, fails this way in about a quarter of the trials (5 of 20, measured).
"""

import json
import os
import random
import signal
import sys
import time

from kvcompress.context_file import ContextFileError, read_context, write_atomically

folder, trials, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
random.seed(seed)
sources = [read_context(os.path.join(folder, f"{name}.safetensors")) for name in ("a", "b")]
checksums = {metadata["checksum"]: name for (metadata, _), name in zip(sources, "ab")}
entry = os.path.join(folder, "store", "0123456789abcdef0123456789abcdef.safetensors")
started = time.perf_counter()  # one write's duration, so that the kills spread over a few writes
write_atomically(sources[0][1], sources[0][0], os.path.join(folder, "scratch.safetensors"))
duration = time.perf_counter() - started
outcomes = []
for trial in range(trials):
    child = os.fork()
    if child == 0:  # the writer: alternate the two files until killed
        while True:
            for metadata, tensors in sources:
                write_atomically(tensors, metadata, entry)
    time.sleep(random.uniform(0.0, 4 * duration))
    os.kill(child, signal.SIGKILL)
    os.waitpid(child, 0)
    if not os.path.exists(entry):
        outcomes.append("none")
        continue
    try:
        outcomes.append(checksums.get(read_context(entry)[0]["checksum"], "another file"))
    except ContextFileError as error:
        outcomes.append(f"error: {error}")
print(json.dumps(outcomes))
