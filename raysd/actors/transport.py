"""How a replica's step calls reach its model actors and their results come back: the seam
between the coordinator (which rows, which micro-batch) and Ray (how).

    transport.submit(target_call, draft_call) -> Pending    one step of one micro-batch
    transport.read(pending) -> (Verdict, StepTimings)       its result, in submission order
    transport.reset()                                        after a failure: the next submit starts afresh

`GraphTransport` runs the step as a Ray compiled graph, set up once (and again after a reset):
driver -> draft.propose -> target.step -> driver, over channels that live as long as the graph
(shared memory on one node; NCCL for a proposal's device tensors between two GPUs), so a step
costs no task submission, no object store and no scheduling. `TaskTransport` runs it as ordinary
actor tasks, for a replica spread over nodes. What a transport decides for itself, from where
the actors are (`Members`): how the proposal travels (host or device), and how this process and
the actors wait for each other on one node's CPUs (the doorbells and the draft's lent threads,
raysd.actors.turns), which the coordinator never sees.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from dataclasses import dataclass

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayChannelTimeoutError

from raysd.actors.turns import Doorbell
from raysd.actors.wire import ActorInfo, StepCall, StepTimedOut, TransferStats, pickled_nbytes
from raysd.engine.verdict import StepTimings, Verdict


@dataclass
class Members:
    """A replica's model actors and what they said of themselves (ActorInfo), as the transport
    needs them: the target's ranks (rank 0 first), the draft actor (None in a colocated replica),
    and the node of the process that drives the steps."""

    targets: list
    draft: object | None
    rank_infos: list[ActorInfo]
    draft_info: ActorInfo
    node: str

    @property
    def target_info(self) -> ActorInfo:
        return self.rank_infos[0]

    @property
    def one_node(self) -> bool:
        """Whether the driver and every actor share a node (the channels are then shared memory)."""
        return len({self.node, self.draft_info.node, *(i.node for i in self.rank_infos)}) == 1


@dataclass(frozen=True)
class TransportConfig:
    """The coordinator's settings a transport reads (CoordinatorConfig's, resolved)."""

    num_micro_batches: int
    lend_draft_threads: bool
    measure_bytes: bool
    step_timeout_s: float | None
    proxy_timeout_s: float  # the compiled graph's driver-side proxy actor's start


@dataclass
class Pending:
    """A step submitted and not yet read."""

    ref: object  # the execution's result (one per target rank for a tensor-parallel target)
    submitted_at: float  # perf_counter
    admitted: bool  # the call took new rows (it prefills them: longer than a plain step)
    ticket: int


class Transport:
    """The interface; see the module's docstring."""

    def __init__(self, members: Members, config: TransportConfig):
        self.members, self.config = members, config
        self.transfer = TransferStats()  # bytes crossing between this process and the actors
        self._tickets = 0
        self._pacer = _ReadPacer()
        self.rung_calls = 0  # calls this process slept through until the target rang (raysd.actors.turns)

    @property
    def colocated(self) -> bool:
        return self.members.draft is None

    def submit(self, target_call: StepCall, draft_call: StepCall | None = None) -> Pending:
        """One step of one micro-batch: `target_call` to the target (every rank), `draft_call` to the
        draft actor of a split replica, whose proposal goes straight to the target."""
        self._tickets += 1
        target_call, draft_call = self._dress(target_call, draft_call)
        ref = self._execute(target_call, draft_call)
        if self.config.measure_bytes:
            self.transfer.target_args += pickled_nbytes(target_call)
            self.transfer.draft_args += 0 if draft_call is None else pickled_nbytes(draft_call)
        return Pending(ref, time.perf_counter(), bool(target_call.new_rows), self._tickets)

    def read(self, pending: Pending) -> tuple[Verdict, StepTimings]:
        """The step's result, once its call has ended (the oldest first: the actors run the steps
        in the order submitted). Waited for as long as the actors live, unless the config's
        step_timeout_s passes since the step was submitted (StepTimedOut). Every rank's output is
        read (a channel left unread fills up); the first failure among them is raised."""
        limit = self.config.step_timeout_s
        deadline = None if limit is None else pending.submitted_at + limit
        self.rung_calls += self._wait(pending, deadline)
        refs = pending.ref if isinstance(pending.ref, list) else [pending.ref]
        outputs, error = [], None
        for ref in refs:
            try:
                outputs.append(self._get(ref, deadline))
            except StepTimedOut:
                self.reset()  # its executions in flight will never be read
                raise
            except Exception as exc:  # noqa: BLE001 - every output is read before the first failure is raised
                error = error or exc
        if error is not None:
            raise error
        verdict, timings = outputs[0]
        self._pacer.ready(timings, self.colocated, pending.admitted)
        self.transfer.steps += 1
        if self.config.measure_bytes:
            self.transfer.results += pickled_nbytes((verdict, timings))
            if verdict.features is not None:
                self.transfer.features += sum(f.numel() * f.element_size() for f in verdict.features)
        return verdict, timings

    def open(self) -> None:
        """Set up what carries the steps now, rather than at the first submit."""

    def reset(self, members: Members | None = None, config: TransportConfig | None = None) -> None:
        """Drop what carries the steps (after a failure; to take other actors, a tensor-parallel
        target's ranks started afresh; or other settings); the next submit sets it up again."""
        self.members = members or self.members
        self.config = config or self.config
        self._pacer = _ReadPacer()

    def close(self) -> None:
        self.reset()

    def take_transfer(self) -> TransferStats:
        """The bytes since the last take, the proposals the draft actor sent its target included
        (counted there, and taken there too); counting starts afresh."""
        out, self.transfer = self.transfer, TransferStats()
        draft = self.members.draft
        if draft is not None and self.config.measure_bytes:
            try:
                sent = ray.get(draft.transfer_stats.remote(), timeout=30)
            except (RayActorError, GetTimeoutError):  # a report only
                return out
            out.proposal, out.dense_equivalent, out.sparse_steps = sent.proposal, sent.dense_equivalent, sent.sparse_steps
        return out

    def _dress(self, target_call: StepCall, draft_call: StepCall | None) -> tuple[StepCall, StepCall | None]:
        """The calls with what this transport adds: the ticket (and where to ring, `GraphTransport`)."""
        target_call = dataclasses.replace(target_call, ticket=self._tickets)
        if draft_call is not None:
            draft_call = dataclasses.replace(draft_call, ticket=self._tickets)
        return target_call, draft_call

    def _execute(self, target_call: StepCall, draft_call: StepCall | None):
        raise NotImplementedError

    def _wait(self, pending: Pending, deadline: float | None) -> bool:
        """Until the call is about to end (a transport that can sleep through it does); whether
        the target rang."""
        return False

    def _get(self, ref, deadline: float | None):
        raise NotImplementedError


def open_transport(members: Members, config: TransportConfig) -> Transport:
    """A compiled graph where the driver and the actors share a node; actor tasks across nodes. In
    Ray 2.60 a compiled graph's channel across nodes, torn down while a remote writer is pushing
    into it (after an actor or a node is lost), fails a CHECK in the reader's raylet
    (experimental_mutable_object_provider.cc, "Channel closed"), which takes that whole node
    down; tasks cost a submission and an object-store round trip per step, which a step across
    nodes pays in its transfers anyway."""
    return GraphTransport(members, config) if members.one_node else TaskTransport(members, config)


class TaskTransport(Transport):
    """The step as ordinary actor tasks: the proposal goes from the draft actor to the target as an
    ObjectRef argument (object store, never through this process). A caller's tasks to one actor
    run in the order submitted."""

    def _execute(self, target_call: StepCall, draft_call: StepCall | None):
        m = self.members
        if draft_call is None:
            refs = [t.step.remote(target_call) for t in m.targets]
        else:
            proposed = m.draft.propose.remote(draft_call)  # one proposal, read by every rank
            refs = [t.step.remote(target_call, proposed) for t in m.targets]
        return refs[0] if len(refs) == 1 else refs

    def _get(self, ref, deadline: float | None):
        try:
            return ray.get(ref, timeout=None if deadline is None else max(0.0, deadline - time.perf_counter()))
        except GetTimeoutError:
            raise _timed_out(self.config.step_timeout_s) from None


class GraphTransport(Transport):
    """The step as a Ray compiled graph (see the module's docstring). Up to `num_micro_batches`
    executions are in flight: the draft proposes for one micro-batch while the target verifies
    another. A tensor-parallel target's ranks all take the same call and the same proposal and
    return one output each (MultiOutputNode)."""

    def __init__(self, members: Members, config: TransportConfig):
        super().__init__(members, config)
        self._graph = None
        self._doorbell = Doorbell() if Doorbell.available() else None  # see `caller_doorbell`

    # What the actors' places allow.

    @property
    def device_channel(self) -> bool:
        """Whether proposals travel as device tensors, GPU to GPU: draft and target on two
        different GPUs (NCCL cannot join two processes on one GPU; those, and CPUs, go through
        the host over shared memory, the proposal lossless sparse where smaller). A tensor-parallel
        target's ranks read the proposal from the host: one small message, N readers."""
        m = self.members
        d, t = m.draft_info.gpu, m.target_info.gpu
        return m.draft is not None and d is not None and t is not None and d != t and len(m.targets) == 1

    @property
    def can_lend(self) -> bool:
        """Whether the draft actor may lend its CPU threads to the target's calls (raysd.actors.
        turns): a draft actor that can (Linux, its CPU) and a target on the same node's CPUs, not
        tensor-parallel. A GPU's step needs no host threads, and another node's cores are not this
        target's to use."""
        m = self.members
        return (self.config.lend_draft_threads and m.draft is not None and m.draft_info.lends_threads
                and len(m.targets) == 1 and m.draft_info.node == m.target_info.node and m.target_info.gpu is None)

    @property
    def lend_threads(self) -> bool:
        """Whether the draft actor lends its threads now: with one micro-batch it idles through every
        target call (with two, it proposes for the other meanwhile)."""
        return self.can_lend and self.config.num_micro_batches == 1

    @property
    def caller_doorbell(self) -> Doorbell | None:
        """Where this process sleeps through each call (`_ReadPacer.wait`) until the target rings
        it: a target on this node's CPUs, whose threads a read spinning in the compiled graph's
        channel (Ray 2.60: sched_yield) would slow, most of all through a call that admits rows
        and prefills them, which the pacer's recent calls cannot time. A GPU's target needs no
        host core, and the read's spin wakes sooner."""
        m = self.members
        same_node = m.target_info.node == m.node and m.target_info.gpu is None
        return self._doorbell if same_node else None

    # The graph.

    def open(self) -> None:
        """Compile the step graph now, before the first step, and wait until its driver-side proxy
        actor runs. Compiling starts that actor (a new Ray worker process, importing Ray: about a
        second of CPU); done at the first step, that start shares the cores with the target's
        first forwards."""
        graph = self._step_graph()
        proxy = getattr(graph, "_proxy_actor", None)  # Ray 2.60's CompiledDAG
        if proxy is not None:
            try:  # it needs no resources, only a worker process: a wait past the placement's means none starts
                ray.get(proxy.__ray_ready__.remote(), timeout=self.config.proxy_timeout_s)
            except GetTimeoutError:
                raise RuntimeError(f"the step graph's driver-side proxy actor did not start within "
                                   f"{self.config.proxy_timeout_s:.0f} s: Ray started no worker process for it on this "
                                   "node (see the raylet's log)") from None

    def reset(self, members: Members | None = None, config: TransportConfig | None = None) -> None:
        if self._graph is not None:
            graph, self._graph = self._graph, None
            try:
                graph.teardown()
            except Exception:  # noqa: BLE001 - an actor of it died: its channels are gone anyway
                pass
        super().reset(members, config)

    def close(self) -> None:
        self.reset()
        if self._doorbell is not None:
            self._doorbell.close()
            self._doorbell = None

    def _step_graph(self):
        if self._graph is not None:
            return self._graph
        from ray.dag import InputNode, MultiOutputNode

        m = self.members
        with InputNode() as calls:
            if m.draft is None:
                outs = [t.step.bind(calls) for t in m.targets]
            else:
                proposed = m.draft.propose.bind(calls[0])
                if self.device_channel:  # the proposal's device tensors travel GPU to GPU (NCCL)
                    proposed = proposed.with_tensor_transport(transport="nccl")
                target_call = calls[1]
                if self.can_lend:  # through a lent call the target sleeps until the proposal is ready
                    target_call = m.targets[0].await_proposal.bind(target_call)
                outs = [t.step.bind(target_call, proposed) for t in m.targets]
                if self.can_lend:  # after proposing, the draft actor sleeps through a call it lent threads to
                    outs.append(m.draft.rest.bind(proposed))
            out = outs[0] if len(outs) == 1 else MultiOutputNode(outs)
        # No fixed deadline on sending a call or reading a result: Ray's default (10 s) would take a
        # slow step (a first step that compiles, a long prefill, a busy machine) for a failure.
        self._graph = out.experimental_compile(_submit_timeout=-1,
                                               _max_inflight_executions=self.config.num_micro_batches + 1)
        return self._graph

    def _dress(self, target_call: StepCall, draft_call: StepCall | None) -> tuple[StepCall, StepCall | None]:
        bell, lend = self.caller_doorbell, self.lend_threads
        target_call = dataclasses.replace(
            target_call, ticket=self._tickets, device_proposal=self.device_channel,
            caller_doorbell=None if bell is None else bell.address,
            # The target sleeps through the drafting of a call the draft lends its threads to.
            proposal_doorbell=self.members.target_info.doorbell if lend else None)
        if draft_call is not None:
            draft_call = dataclasses.replace(draft_call, ticket=self._tickets, device_proposal=self.device_channel,
                                             caller_doorbell=target_call.caller_doorbell, lend_threads=lend,
                                             proposal_doorbell=target_call.proposal_doorbell)
        return target_call, draft_call

    def _execute(self, target_call: StepCall, draft_call: StepCall | None):
        graph = self._step_graph()
        return graph.execute(target_call) if draft_call is None else graph.execute(draft_call, target_call)

    def _wait(self, pending: Pending, deadline: float | None) -> bool:
        return self._pacer.wait(pending, self.caller_doorbell, deadline)

    def _get(self, ref, deadline: float | None):
        """Ray ends an unbounded read when an actor of the graph dies (its monitor tears the graph
        down and the read raises)."""
        if deadline is None:
            return ref.get(timeout=-1)
        try:
            out = ref.get(timeout=max(0.0, deadline - time.perf_counter()))
            if time.perf_counter() <= deadline:
                return out
        except RayChannelTimeoutError:
            pass
        raise _timed_out(self.config.step_timeout_s)


def _timed_out(limit: float) -> StepTimedOut:
    return StepTimedOut(f"a step took longer than {limit:g} s (the step timeout, --step-timeout); "
                        "its actors are alive but did not answer in time")


class _ReadPacer:
    """When to start waiting for a step's result. Ray 2.60's compiled-graph channel read spins
    (sched_yield in PlasmaObjectHeader::ReadAcquire) for as long as it waits, so a coordinator
    that read at once would burn a core for the whole of every step: a core the target's torch
    threads need where cores are few. Where the target rings a doorbell at each call's end
    (GraphTransport.caller_doorbell), `wait` sleeps on that, bounded by a few expected calls' time
    (a target lost mid-call never rings; the read then reports the loss). Elsewhere it naps until
    just before the call is expected to end: from when the target could start it (its submission
    plus the draft's proposing, or the previous result, whichever is later) plus the target's
    time, less a slack (SLACK_FRACTION of that time + SLACK_S) spent spinning.

    The times are the shortest of the last RECENT calls that admitted no rows, once there are
    TRUSTED of them: a call with new rows also prefills them, and a replica's first calls run while
    its processes still start, so either can take several times a steady call, and a nap planned
    from one would oversleep the next. Until then, and for a step cheaper than the last ones, the
    read errs early: spinning costs some CPU, oversleeping the whole step's idle target."""

    SLACK_FRACTION = 0.05
    SLACK_S = 3e-4
    MIN_NAP_S = 5e-4  # below it, sleeping's own wake-up jitter costs more than the spin
    RECENT = 8
    TRUSTED = 2
    FIRST_BELL_TIMEOUT_S = 10.0  # before any call was read, the ring is awaited this long, then the read spins

    def __init__(self):
        self.ready_at = 0.0  # perf_counter when the last result was read
        self.recent: deque[tuple[float, float]] = deque(maxlen=self.RECENT)  # (target's, draft actor's) seconds per call
        self.admitting_s: float | None = None  # the last call's that admitted rows (target's + draft actor's)

    def wait(self, pending: Pending, bell: Doorbell | None, deadline: float | None) -> bool:
        """Until the call is about to end; whether the target rang."""
        if bell is None:
            self.nap(pending.submitted_at)
            return False
        timeout = self.bell_timeout_s(pending.admitted)
        if deadline is not None:
            timeout = max(0.0, min(timeout, deadline - time.perf_counter()))
        return bell.wait_for(pending.ticket, timeout)

    def bell_timeout_s(self, admitted: bool) -> float:
        if admitted:
            expected = self.admitting_s
        else:
            expected = min(t + d for t, d in self.recent) if self.recent else None
        return self.FIRST_BELL_TIMEOUT_S if expected is None else Doorbell.timeout_s(expected)

    def nap(self, submitted_at: float) -> None:
        if len(self.recent) < self.TRUSTED:
            return
        target_s = min(t for t, _ in self.recent)
        draft_s = min(d for _, d in self.recent)
        ends = max(submitted_at + draft_s, self.ready_at) + target_s
        delay = ends - self.SLACK_FRACTION * target_s - self.SLACK_S - time.perf_counter()
        if delay > self.MIN_NAP_S:
            time.sleep(delay)

    def ready(self, timings: StepTimings, colocated: bool, admitted: bool = False) -> None:
        """A result was read: `timings` its call's, `admitted` whether the call took new rows."""
        self.ready_at = time.perf_counter()
        draft_s = 0.0 if colocated else timings.draft_s
        if admitted:
            self.admitting_s = timings.wall_s + draft_s
        else:
            self.recent.append((timings.wall_s, draft_s))

