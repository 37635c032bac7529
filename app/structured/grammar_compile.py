"""Grammars compile in worker processes of their own, each compile with a deadline, so that no schema can cost
unbounded CPU or hold up anything but other compiles.

xgrammar's compile time has no static bound worth the name. Measured here on Qwen2.5's 151,936-token vocabulary
(AMD EPYC Zen 5): 1,000 required properties took 17 s, `anyOf` over 500 small objects 47 s, and the pattern
`((a{0,30}){0,30}){0,30}` 53 s, each from a body of a few KB. app/structured/grammars.py refuses the known shapes
(deep nesting, large repetition bounds) before any compile; this module bounds the rest in time. A thread cannot
be stopped, but a process can: each compile runs in a child process that holds the tokenizer's tables, and past
the deadline the child is killed (a new one starts for the next compile) and the caller gets `CompileTimeout`.
Memory is bounded too: once its tables are loaded, the child caps its own address space (RLIMIT_AS) at what it
holds plus `memory_bytes`, so a compile that would grow past that (an enum of 20,000 strings took 1.9 GiB) fails
its allocation instead of pressing on the server; the child then exits, a new one takes the next compile, and the
caller gets `CompileOutOfMemory`.

The children are plain `python -m app.structured.grammar_compile` processes that speak length-prefixed frames over their
stdin and stdout: the serialized `TokenizerInfo` once, then one request and one answer per compile. A compiled
grammar travels back serialized (~20 KB to a few MB, 10-70 ms to deserialize for Qwen's vocabulary).
"""

from __future__ import annotations

import json
import os
import resource
import queue
import struct
import subprocess
import sys
import threading
import weakref
from typing import BinaryIO

_HEADER = struct.Struct("<Q")  # each frame: its length, then its bytes
OK, FAILED, OUT_OF_MEMORY = b"\x00", b"\x01", b"\x02"
NICENESS = 10  # added to the worker's nice value
MEMORY_BYTES = 2**30  # address space a compile may add to what a ready worker holds
WORKER_COMMAND = (sys.executable, "-m", "app.structured.grammar_compile")  # then the memory limit


class CompileTimeout(Exception):
    """The compile ran past its deadline; its worker was killed."""


class CompileFailed(Exception):
    """The grammar library refused the spec; the message is the library's own."""


class CompileOutOfMemory(Exception):
    """The compile needed more than its worker's memory limit; the worker was replaced."""


class WorkerFailed(Exception):
    """The worker process did not start: the server's fault, not the spec's."""


def read_frame(stream: BinaryIO) -> bytes | None:
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack(header)
    data = stream.read(size)
    return data if len(data) == size else None


def write_frame(stream: BinaryIO, data: bytes) -> None:
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


class CompileWorker:
    """One child process; one compile at a time (the pool hands each worker to one thread at a time).

    A worker that is replaced (past a deadline, out of memory) gives back all it held at once: the process is killed
    and reaped, its two pipes closed, and its finalizer detached. A finalizer left registered kept the dead process
    and its pipes for the server's life: two descriptors per replaced worker, until a client whose schemas kept
    hitting the deadline ran the server out of descriptors."""

    def __init__(self, tokenizer_info_json: str, memory_bytes: int = MEMORY_BYTES):
        self._info = tokenizer_info_json.encode()
        self._memory_bytes = memory_bytes
        self._proc: subprocess.Popen | None = None
        self._release: weakref.finalize | None = None  # releases self._proc; calling it detaches it

    def _start(self) -> subprocess.Popen:
        # The child imports torch (through xgrammar): keep its threads few. Few malloc arenas, too: each reserves
        # 64 MiB of address space, which the memory limit counts.
        env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_ARENA_MAX="2")
        proc = subprocess.Popen([*WORKER_COMMAND, str(self._memory_bytes)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, env=env)
        # A worker lives no longer than this object: a Grammars dropped without close() (a test's, say) would
        # otherwise leave its ~300 MB process idle until this whole process exits and closes its stdin.
        self._release = weakref.finalize(self, _release, proc)
        try:
            write_frame(proc.stdin, self._info)
            ready = read_frame(proc.stdout) == OK  # it has loaded the tables and is ready
        except OSError:
            ready = False
        if not ready:
            self._stop()
            raise WorkerFailed(f"the grammar compile worker did not start (exit code {proc.returncode})")
        return proc

    def compile(self, request: dict, timeout_s: float) -> str:
        """The serialized CompiledGrammar; CompileFailed for a refused spec, CompileTimeout past the deadline,
        CompileOutOfMemory past the memory limit, WorkerFailed if no worker would start."""
        if self._proc is None or self._proc.poll() is not None:
            self._stop()  # one that died on its own gives back its pipes too
            self._proc = self._start()  # not counted in the deadline: that is the compile's own time
        proc = self._proc
        expired = threading.Event()
        timer = threading.Timer(timeout_s, lambda: (expired.set(), proc.kill()))
        timer.start()
        try:
            write_frame(proc.stdin, json.dumps(request).encode())
            answer = read_frame(proc.stdout)
        except OSError:
            answer = None
        finally:
            timer.cancel()
        if answer is None or answer[:1] == OUT_OF_MEMORY:  # the next compile starts a new worker
            self._stop()
            # a child that died before its deadline ran out of memory where the library could not say so (an
            # allocation failing in a thread of its own aborts the process)
            raise CompileTimeout() if expired.is_set() else CompileOutOfMemory()
        if answer[:1] == FAILED:
            raise CompileFailed(answer[1:].decode(errors="replace"))
        return answer[1:].decode()

    def _stop(self) -> None:
        """Release the process (if any) now, and forget it."""
        if self._release is not None:
            self._release()  # runs once, then is dead: nothing of the process stays referenced
        self._release = self._proc = None

    def close(self) -> None:
        self._stop()


def _release(proc: subprocess.Popen) -> None:
    """Kill, close both pipes, reap: a replaced worker keeps no process, zombie or descriptor."""
    if proc.poll() is None:
        proc.kill()
    for pipe in (proc.stdin, proc.stdout):
        try:
            pipe.close()
        except OSError:  # stdin's buffer, flushed into a dead process's pipe
            pass
    proc.wait()


class CompilePool:
    """`workers` child processes, started on first use; `compile` blocks until one is free and has answered."""

    def __init__(self, tokenizer_info_json: str, workers: int, memory_bytes: int = MEMORY_BYTES):
        self._idle: queue.SimpleQueue[CompileWorker] = queue.SimpleQueue()
        self._workers = [CompileWorker(tokenizer_info_json, memory_bytes) for _ in range(workers)]
        for worker in self._workers:
            self._idle.put(worker)

    def compile(self, request: dict, timeout_s: float) -> str:
        worker = self._idle.get()
        try:
            return worker.compile(request, timeout_s)
        finally:
            self._idle.put(worker)

    def close(self) -> None:
        for worker in self._workers:
            worker.close()


def _limit_memory(extra_bytes: int) -> None:
    """Cap this process's address space at what it holds now plus `extra_bytes`."""
    with open("/proc/self/statm") as statm:
        held = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (held + extra_bytes, resource.RLIM_INFINITY))


def _serve(memory_bytes: int) -> None:
    """The child: load the tokenizer's tables, then compile what arrives until stdin closes."""
    out = os.fdopen(os.dup(1), "wb")  # frames only: anything a library prints goes to stderr instead
    os.dup2(2, 1)
    # Below the server in the CPU's queue: a long compile must not slow the event loop or the decode steps.
    os.nice(NICENESS)
    inp = sys.stdin.buffer
    import xgrammar as xgr

    info = xgr.TokenizerInfo.deserialize_json(read_frame(inp).decode())
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)  # the parent caches, with a bound
    _limit_memory(memory_bytes)
    write_frame(out, OK)
    while (frame := read_frame(inp)) is not None:
        request = json.loads(frame)
        try:
            if request["kind"] == "json_schema":
                compiled = compiler.compile_json_schema(request["spec"], any_whitespace=True, strict_mode=False,
                                                        max_whitespace_cnt=request["max_whitespace"])
            elif request["kind"] == "regex":
                compiled = compiler.compile_regex(json.loads(request["spec"]))
            elif request["kind"] == "grammar":
                compiled = compiler.compile_grammar(json.loads(request["spec"]))
            else:
                compiled = compiler.compile_structural_tag(request["spec"])
            write_frame(out, OK + compiled.serialize_json().encode())
        except Exception as err:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError for specs it refuses
            # xgrammar reports a failed allocation as a RuntimeError saying std::bad_alloc; the heap may be left in
            # pieces, so answer and let a fresh worker take the next compile
            if isinstance(err, MemoryError) or "bad_alloc" in str(err):
                write_frame(out, OUT_OF_MEMORY)
                return
            write_frame(out, FAILED + str(err).encode())


if __name__ == "__main__":
    _serve(int(sys.argv[1]) if len(sys.argv) > 1 else MEMORY_BYTES)
