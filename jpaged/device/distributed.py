"""Several processes, one engine: JAX's own distributed runtime (`jax.distributed`).

Every process runs the same program on its local devices; together they see one global set of
devices (`jax.devices()`), over which the sharded engine (`jpaged.device.sharding`) lays out the
model and the KV pool exactly as on one process. Each process runs the same deterministic
scheduler on the same request stream: process 0 receives the requests and `broadcast` hands them
to the others, and the sampled tokens come back replicated, so every process takes the same
decisions, step after step.

    from jpaged.device import distributed
    distributed.initialize("10.0.0.1:1234", num_processes=2, process_id=0)  # first, before any JAX work
    llm = LLM(data_parallel_size=2, tensor_parallel_size=3)                   # on 2 x 3 global devices
    outs = llm.generate(prompts, params)   # process 0's prompts and params, run (and returned) everywhere

Joining: `initialize` says at once (on stderr, or to its `progress` callback) that this process waits
for the others, at which address, how many have joined and for how long; process 0 names each process
that joins. The processes meet on the coordinator's port before JAX's own runtime starts there, so a
process that waits in vain ends after `initialization_timeout` seconds (`--join-timeout`) with one
line naming the processes missing (ValueError), and a wrong `--num-processes` or a process id given
twice is refused at once, where JAX's own handshake would wait, then abort the process.

On CPUs the collectives go through gloo; each process's CPU devices are forced as usual
(`XLA_FLAGS=--xla_force_host_platform_device_count=N` before JAX starts).

A request stream that arrives while the engine runs (`jpaged serve`): `open_link` (a collective, after
`initialize`) connects process 0 to every other process beside JAX's runtime, on a port of process 0's
host the system chooses (handed over with `broadcast`). Process 0 `send`s each step's new requests and
aborts, the others `receive` them in order (`jpaged.engine.lockstep` does the stepping). The link is
also how a process learns that another went away: a killed or crashed process's sockets close at once,
a hung or unreachable one stops its heartbeats (every second; given up after 30 s of silence), and
`on_lost(message)` is called from the link's own thread, with one line naming the process, even while
the main thread waits in a collective that will never return (gloo has no timeout; JAX's coordination
service would abort the process only after its 100 s heartbeat timeout). `close` ends the link in order.

What holds across processes: `LLM.generate` / `chat` broadcast process 0's requests and return the
outputs on every process; the CLI (`jpaged generate --coordinator-address HOST:PORT --num-processes N
--process-id I`) prints on process 0 alone; `jpaged serve` with the same flags serves HTTP on process 0
alone, every process stepping in lockstep, and a process that goes away ends the others (within about a
second, one `error:` line each; process 0 first answers its open requests with the error). Preemption by
swap works: swapped blocks come back
replicated, and every process keeps the same CPU swap pool. With `LLMEngine` directly, add the same
requests in the same order on every process (`broadcast` them from process 0) and abort none from
another thread: a process that schedules otherwise than the others waits in a collective forever.
Pausing an engine (`LLMEngine.save` / `restore`) is refused. Each process checks the pool against its
own memory (the whole pool's bytes: conservative). `broadcast` unpickles what process 0 sent: the
processes of one job trust one another.
"""

from __future__ import annotations

import pickle
import re
import socket
import sys
import time
from typing import Callable, Optional

import jax
import numpy as np


def check_address(coordinator_address: str, num_processes: int, process_id: int, *,
                  initialization_timeout: float = 300) -> None:
    """Raises ValueError (one line) unless these name a coordinator HOST:PORT, a number of processes
    >= 1, this process's id among them and a join timeout of seconds > 0. Touches nothing: call it
    before anything loads."""
    if not (isinstance(num_processes, int) and not isinstance(num_processes, bool) and num_processes >= 1):
        raise ValueError(f"the number of processes (--num-processes) must be an integer >= 1, got {num_processes!r}")
    if not (isinstance(process_id, int) and not isinstance(process_id, bool) and 0 <= process_id < num_processes):
        raise ValueError(f"the process id (--process-id) must be in 0..{num_processes - 1} for {num_processes} "
                         f"process{'es' if num_processes > 1 else ''}, got {process_id!r}")
    match = re.fullmatch(r"(\[[0-9a-fA-F:.]+\]|[^:\s\[\]]+):([0-9]{1,5})", str(coordinator_address))
    if coordinator_address is None or not match or not 0 < int(match[2]) < 65536:
        raise ValueError("the coordinator address (--coordinator-address) must be HOST:PORT, process 0's "
                         f"(e.g. 10.0.0.1:1234), got {coordinator_address!r}")
    if not (isinstance(initialization_timeout, (int, float)) and not isinstance(initialization_timeout, bool)
            and 0 < initialization_timeout < float("inf")):
        raise ValueError(f"--join-timeout must be a number of seconds > 0 (how long to wait for the others to "
                         f"join), got {initialization_timeout!r}")


def initialize(coordinator_address: str, num_processes: int, process_id: int, *,
               initialization_timeout: float = 300, progress: Optional[Callable[[str], None]] = None) -> None:
    """Joins this process to the others through `jax.distributed.initialize`, with CPU collectives
    through gloo. Call it in every process, before anything else uses JAX; `coordinator_address` is
    process 0's HOST:PORT (process 0 listens there). Already joined (here or by
    `jax.distributed.initialize`) as this process among as many: does nothing.

    Before JAX's runtime starts, the processes meet at that address (`_rendezvous`): `progress`
    (default: a `[jpaged] ...` line on stderr) is told at once that this process waits, where, how
    many of the processes have joined and for how long, and again as they join. When they have not
    all joined within `initialization_timeout` seconds, raises ValueError (one line: who is missing,
    and what to change) instead of waiting on: JAX's own timeout ends the process with a C++ abort."""
    check_address(coordinator_address, num_processes, process_id, initialization_timeout=initialization_timeout)
    if jax.distributed.is_initialized():
        if (jax.process_count(), jax.process_index()) != (num_processes, process_id):
            raise ValueError(f"this process already runs as process {jax.process_index()} of {jax.process_count()}, "
                             f"not {process_id} of {num_processes}")
        return
    if progress is None:
        progress = lambda message: print(f"[jpaged] {message}", file=sys.stderr, flush=True)  # noqa: E731
    if num_processes > 1:
        _rendezvous(coordinator_address, num_processes, process_id, initialization_timeout, progress)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # every process is up and has been told to go: JAX's own handshake takes a moment
    jax.distributed.initialize(coordinator_address, num_processes=num_processes, process_id=process_id,
                               initialization_timeout=max(60, int(initialization_timeout)))


# ---- the rendezvous: a line protocol on the coordinator's port, before JAX's service listens there
#   joining process -> process 0:  "jpaged-join <process_id> <num_processes>"
#   process 0 -> joining process:  "joined <count>" (then again as others join), "go" once all have,
#                                  or "error <message>" (a wrong --num-processes, a process id twice)

_HELLO = "jpaged-join"


def _rendezvous(address: str, num_processes: int, process_id: int, timeout: float, progress) -> None:
    """Returns once all `num_processes` processes have met at `address` (process 0 listening there);
    raises ValueError saying who is missing after `timeout` seconds."""
    host, port = address.rsplit(":", 1)
    host, port = host.strip("[]"), int(port)
    deadline = time.monotonic() + timeout
    if process_id == 0:
        _gather(address, port, num_processes, deadline, timeout, progress)
    else:
        _join(address, host, port, num_processes, process_id, deadline, timeout, progress)


def _gather(address, port, num_processes, deadline, timeout, progress) -> None:
    """Process 0: accepts the others' hellos until all have come, then tells them all to go."""
    try:  # on every address, as JAX's service binds ([::]:PORT)
        listener = (socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True)
                    if socket.has_dualstack_ipv6() else socket.create_server(("", port)))
    except OSError as e:
        raise ValueError(f"process 0 cannot listen on port {port} ({e.strerror}): give --coordinator-address "
                         "a free port of this machine (is another process 0 running?)") from None
    joined: dict[int, socket.socket] = {}
    progress(f"process 0 of {num_processes}: waiting for the others at {address}: 1 of {num_processes} joined "
             f"(this one); waiting up to {timeout:g} s (--join-timeout)")
    try:
        with listener:
            listener.settimeout(0.25)
            while len(joined) + 1 < num_processes:
                if time.monotonic() > deadline:
                    missing = [i for i in range(1, num_processes) if i not in joined]
                    message = (f"only {len(joined) + 1} of {num_processes} processes joined at {address} within "
                               f"{timeout:g} s (missing: --process-id {', '.join(map(str, missing))}): start "
                               f"{'it' if len(missing) == 1 else 'them'} with this --coordinator-address and "
                               f"--num-processes {num_processes}, or raise --join-timeout")
                    for conn in joined.values():  # the ones that came give up too, with the same line
                        _send(conn, f"error {message}")
                    raise ValueError(message)
                try:
                    conn, _ = listener.accept()
                except (socket.timeout, InterruptedError):
                    continue
                joiner = _hello(conn, num_processes, joined, progress)
                if joiner is None:
                    conn.close()
                    continue
                joined[joiner] = conn
                for other in joined.values():  # everyone learns how many are here
                    _send(other, f"joined {len(joined) + 1}")
                progress(f"process {joiner} joined: {len(joined) + 1} of {num_processes}")
            for conn in joined.values():
                _send(conn, "go")
            for conn in joined.values():  # they close first: the port stays free of TIME_WAIT for JAX's service
                conn.settimeout(5)
                try:
                    conn.recv(1)
                except OSError:
                    pass
    finally:
        for conn in joined.values():
            conn.close()
    progress(f"all {num_processes} processes joined; starting JAX's distributed runtime")


def _hello(conn: socket.socket, num_processes: int, joined: dict, progress) -> Optional[int]:
    """Reads a joining process's hello; its process id, or None (both told why) when it cannot join."""
    conn.settimeout(5)
    try:
        words = _readline(conn).split()
    except OSError:
        return None
    if len(words) != 3 or words[0] != _HELLO or not (words[1].isdigit() and words[2].isdigit()):
        return None  # not one of ours
    joiner, their_num = int(words[1]), int(words[2])
    if their_num != num_processes:
        reason = (f"process 0 runs with --num-processes {num_processes}, process {joiner} with {their_num}: "
                  "give every process the same --num-processes")
    elif joiner in joined and not _closed(joined[joiner]):
        reason = f"process id {joiner} has joined already: give each process its own --process-id"
    else:
        if joiner in joined:  # an earlier attempt of that process that has gone away
            joined.pop(joiner).close()
        return joiner
    _send(conn, f"error {reason}")
    progress(f"refused a process: {reason}")
    return None


def _join(address, host, port, num_processes, process_id, deadline, timeout, progress) -> None:
    """A process other than 0: says hello to process 0 (retrying until it listens), waits for "go"."""
    progress(f"process {process_id} of {num_processes}: joining process 0 at {address}; waiting up to "
             f"{timeout:g} s (--join-timeout) for all {num_processes} processes to join")
    last_error, count = "", None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            if count is None:
                raise ValueError(f"process 0 did not answer at {address} within {timeout:g} s ({last_error}): start "
                                 "it (the same command with --process-id 0), check --coordinator-address, or raise "
                                 "--join-timeout")
            raise ValueError(f"only {count} of {num_processes} processes joined at {address} within {timeout:g} s: "
                             f"start the others with this --coordinator-address and --num-processes "
                             f"{num_processes}, or raise --join-timeout")
        try:
            conn = socket.create_connection((host, port), timeout=min(left, 5))
        except socket.gaierror as e:
            raise ValueError(f"cannot resolve the coordinator host {host!r} ({e.strerror}): check "
                             "--coordinator-address") from None
        except OSError as e:
            last_error = (e.strerror or str(e)).lower()
            time.sleep(min(0.25, max(left, 0)))
            continue
        with conn:
            try:
                _send(conn, f"{_HELLO} {process_id} {num_processes}")
                while True:
                    conn.settimeout(max(deadline - time.monotonic(), 0.01))
                    line = _readline(conn)
                    if line == "go":
                        return
                    if line.startswith("error "):
                        raise ValueError(line[len("error "):])
                    if not line.startswith("joined "):
                        raise ValueError(f"{address} answered, but not as jpaged's process 0: check "
                                         "--coordinator-address")
                    if count is None:
                        progress(f"reached process 0 at {address}; {line.split()[1]} of {num_processes} joined")
                    count = int(line.split()[1])
            except (socket.timeout, TimeoutError):
                continue  # the deadline has passed: said above
            except OSError as e:  # process 0 went away: try again while there is time
                last_error = (e.strerror or str(e)).lower()


def _send(conn: socket.socket, line: str) -> None:
    try:
        conn.sendall(line.encode() + b"\n")
    except OSError:
        pass  # gone: noticed when it matters


def _readline(conn: socket.socket) -> str:
    data = b""
    while not data.endswith(b"\n"):
        part = conn.recv(1)
        if not part:
            raise ConnectionResetError("the connection closed")
        data += part
        if len(data) > 4096:
            return ""
    return data.decode(errors="replace").strip()


def _closed(conn: socket.socket) -> bool:
    """Whether the peer of `conn` has gone (it never sends after its hello)."""
    try:
        conn.setblocking(False)
        return conn.recv(1, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True
    finally:
        conn.setblocking(True)


def broadcast(value):
    """`value` as process 0 has it, on every process (any picklable object; with one process, `value`
    itself). Every process must call it at the same point of the program: it is a collective."""
    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils

    payload = np.frombuffer(pickle.dumps(value), np.uint8) if jax.process_index() == 0 else np.zeros(0, np.uint8)
    size = int(multihost_utils.broadcast_one_to_all(np.int64(payload.size)))
    padded = np.zeros(size, np.uint8)
    padded[:payload.size] = payload
    return pickle.loads(np.asarray(multihost_utils.broadcast_one_to_all(padded)).tobytes())


# ---- the link: process 0's own line to every other process, beside JAX's runtime
#   frames on TCP: a 4-byte big-endian length, then that many bytes of pickle; length 0 is a heartbeat,
#   _BYE says that the sender closes in order (its connection closing afterwards is no loss)

_BYE = 2**32 - 1
_END = object()  # in a follower's inbox: process 0 closed the link in order


class LinkLost(RuntimeError):
    """A process of the job went away (killed, crashed, hung or unreachable): the message, one line,
    says which and how it was noticed."""


class Link:
    """Process 0's connection to each other process, for messages that every process must see in the
    same order (`send` on process 0, `receive` on the others), and each end told at once when the
    other goes away. Built by `open_link`, a collective.

    Why beside JAX's runtime: a process that dies leaves the others waiting in a collective forever
    (gloo on CPUs has no timeout), and JAX's coordination service notices only after its heartbeat
    timeout (100 s), then aborts the process with a C++ error. Here a process killed or crashed has
    its sockets closed by its system, which its peer sees at once; one that hangs or becomes
    unreachable stops its heartbeats (every `heartbeat_s`, from a thread of its own) and is given up
    after `timeout_s` of silence. Either way `on_lost(message)` is called once, from the link's reader
    thread, whatever the main thread is stuck in, with one line naming the process and what happened;
    afterwards `send` and `receive` raise `LinkLost` with it. A peer's closing after `close` is no loss.
    Messages are pickled: the processes of one job trust one another (as for `broadcast`).
    """

    def __init__(self, conns: dict, *, process_id: int, num_processes: int, heartbeat_s: float, timeout_s: float,
                 on_lost: Optional[Callable[[str], None]] = None):
        import queue
        import threading

        self.process_id, self.num_processes = process_id, num_processes
        self.heartbeat_s, self.timeout_s = heartbeat_s, timeout_s
        self.lost: Optional[str] = None  # the message, once a peer went away
        self._conns = conns  # peer process id -> socket (process 0: every other process; the others: {0: ...})
        self._on_lost = on_lost
        self._inbox: queue.Queue = queue.Queue()
        self._send_lock, self._state_lock = threading.Lock(), threading.Lock()
        self._closing = False
        self._stopped, self._lost = threading.Event(), threading.Event()
        for peer, conn in conns.items():
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(timeout_s)  # a read (or a send) that waits this long: the peer is given up
            threading.Thread(target=self._read, args=(peer, conn), name=f"jpaged-link-{peer}", daemon=True).start()
        threading.Thread(target=self._beat, name="jpaged-link-heartbeat", daemon=True).start()

    def send(self, message) -> None:
        """Process 0: `message` to every other process, in order. Raises LinkLost once one went away."""
        payload = pickle.dumps(message)
        self._write(len(payload).to_bytes(4, "big") + payload)

    def receive(self):
        """Another process: process 0's next message; None once process 0 closed the link in order.
        Raises LinkLost when process 0 went away."""
        item = self._inbox.get()
        if item is _END or isinstance(item, LinkLost):
            self._inbox.put(item)  # and again for any later call
            if item is _END:
                return None
            raise item
        return item

    def wait_lost(self, timeout: float) -> bool:
        """Whether a peer has gone away, or does within `timeout` seconds."""
        return self._lost.wait(timeout)

    def close(self) -> None:
        """Ends the link in order: the others learn that what follows (this process's sockets closing)
        is no loss. Idempotent."""
        with self._state_lock:
            if self._closing:
                return
            self._closing = True
        self._stopped.set()
        with self._send_lock:
            for conn in self._conns.values():
                try:
                    conn.sendall(_BYE.to_bytes(4, "big"))
                    conn.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
        for conn in self._conns.values():
            conn.close()

    def _write(self, frame: bytes) -> None:
        if self.lost is not None:
            raise LinkLost(self.lost)
        with self._send_lock:
            for peer, conn in self._conns.items():
                try:
                    conn.sendall(frame)
                except OSError as e:
                    if not self._closing:
                        self._lose(f"{self._name(peer)} went away (sending to it failed: "
                                   f"{(e.strerror or str(e)).lower()}; killed or crashed?)")
                    raise LinkLost(self.lost or "the link is closed") from None

    def _beat(self) -> None:
        while not self._stopped.wait(self.heartbeat_s):
            try:
                self._write(b"\0\0\0\0")
            except LinkLost:
                return

    def _read(self, peer: int, conn: socket.socket) -> None:
        try:
            while True:
                size = int.from_bytes(_recv_exactly(conn, 4), "big")
                if size == _BYE:
                    if peer != 0:  # another process may not leave a running engine: process 0 cannot go on
                        self._lose(f"{self._name(peer)} stopped (it closed its connection to process 0; its own "
                                   "output says why)")
                        return
                    with self._state_lock:  # process 0 ended the link: nothing that follows is a loss
                        self._closing = True
                    self._stopped.set()
                    self._inbox.put(_END)
                    return
                if size:
                    self._inbox.put(pickle.loads(_recv_exactly(conn, size)))
        except socket.timeout:
            self._lose(f"{self._name(peer)} sent nothing for {self.timeout_s:g} s, not even its heartbeat "
                       "(hung, or its machine unreachable)")
        except (OSError, EOFError):
            self._lose(f"{self._name(peer)} went away (its connection closed: killed or crashed?)")
        except Exception as e:  # noqa: BLE001 - an unreadable message: the processes run different code
            self._lose(f"{self._name(peer)} sent a message this process cannot read ({type(e).__name__}: {e}): run "
                       "the same jpaged on every process")

    def _name(self, peer: int) -> str:
        return f"process {peer} of {self.num_processes}"

    def _lose(self, message: str) -> None:
        with self._state_lock:
            if self._closing or self.lost is not None:
                return
            self.lost = message
        self._stopped.set()
        self._lost.set()
        self._inbox.put(LinkLost(message))
        if self._on_lost is not None:
            self._on_lost(message)


def _recv_exactly(conn: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        part = conn.recv(min(size - len(data), 1 << 20))
        if not part:
            raise EOFError("the connection closed")
        data += part
    return bytes(data)


def open_link(coordinator_address: str, *, heartbeat_s: float = 1.0, timeout_s: float = 30.0,
              on_lost: Optional[Callable[[str], None]] = None, connect_timeout: float = 60.0) -> Link:
    """The `Link` between process 0 and every other process: a collective (every process calls it once,
    after `initialize`, with the same `coordinator_address`). Process 0 listens on a port the system
    chooses, on every address (as the coordinator does), and hands it to the others with `broadcast`;
    they connect to the coordinator's host at that port. With one process: a link to nobody."""
    num_processes, process_id = jax.process_count(), jax.process_index()
    host = str(coordinator_address).rsplit(":", 1)[0].strip("[]")
    kwargs = dict(process_id=process_id, num_processes=num_processes, heartbeat_s=heartbeat_s, timeout_s=timeout_s,
                  on_lost=on_lost)
    if num_processes == 1:
        return Link({}, **kwargs)
    listener = None
    if process_id == 0:
        listener = (socket.create_server(("", 0), family=socket.AF_INET6, dualstack_ipv6=True)
                    if socket.has_dualstack_ipv6() else socket.create_server(("", 0)))
    port = broadcast(listener.getsockname()[1] if listener is not None else None)
    deadline = time.monotonic() + connect_timeout
    conns: dict[int, socket.socket] = {}
    if listener is None:
        try:
            conn = socket.create_connection((host, port), timeout=connect_timeout)
            _send(conn, f"jpaged-link {process_id}")
        except OSError as e:
            raise ValueError(f"process {process_id} cannot reach process 0 at {host}:{port}, the port it listens on "
                             f"for the engine's requests ({(e.strerror or str(e)).lower()}): let the processes reach "
                             "each other on any port of process 0's host") from None
        return Link({0: conn}, **kwargs)
    with listener:
        listener.settimeout(1.0)
        while len(conns) < num_processes - 1:
            if time.monotonic() > deadline:
                for conn in conns.values():
                    conn.close()
                missing = [i for i in range(1, num_processes) if i not in conns]
                raise ValueError(f"process {', '.join(map(str, missing))} did not connect to process 0's port {port} "
                                 f"within {connect_timeout:g} s: let the processes reach each other on any port of "
                                 "process 0's host")
            try:
                conn, _ = listener.accept()
            except (socket.timeout, InterruptedError):
                continue
            conn.settimeout(5)
            try:
                words = _readline(conn).split()
            except OSError:
                words = []
            if len(words) == 2 and words[0] == "jpaged-link" and words[1].isdigit() and int(words[1]) not in conns:
                conns[int(words[1])] = conn
            else:
                conn.close()
    return Link(conns, **kwargs)
