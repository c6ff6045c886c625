"""Which tokens run in the next step: waiting and running queues, a token budget, preemption.

Every running sequence that is decoding contributes one token; the rest of the step's token
budget goes to prefill, in chunks, oldest request first. Chunk boundaries sit at fixed
multiples of `prefill_chunk` in the sequence, whatever else runs in the step, so a prompt is cut
the same way alone or in a crowd (part of what keeps a request's numbers batch-independent).
When a decoding sequence needs a block and none is left, the newest running sequence is
preempted: its blocks are released and it is recomputed from its tokens when there is room.

With a sliding window on every attention layer (`window`), a block whose tokens all lie before
the window of the sequence's next query is released as soon as the sequence moves past it; its
table entry becomes FREED (read as the zero block, which the window masks anyway). A model that
mixes windowed and global layers (`local`) keeps a second table per sequence for the windowed
layers' own pool and frees that one the same way (window_blocks.py). A model
with recurrent layers (`states`) gives each running sequence a state slot from admission until
it finishes or is preempted.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kiln.serve.engine.block_pool import FREED, BlockKey, BlockPool, block_keys
from kiln.serve.engine.paged_cache import Segment

if TYPE_CHECKING:
    from kiln.serve.engine.state_pool import StatePool
    from kiln.serve.engine.window_blocks import WindowBlocks


@dataclass(eq=False)
class Sequence:
    """One sample of a request: its tokens, how many are in the cache, and its block table."""

    tokens: list[int]
    prompt_len: int
    arrival: int  # order of admission to the engine: older sequences are served first
    owner: Any = None  # the engine's per-sample state
    num_computed: int = 0  # tokens whose keys and values are in the blocks
    blocks: list[int] = field(default_factory=list)
    registered: int = 0  # leading blocks already offered to the prefix cache
    keys: list[BlockKey] = field(default_factory=list)  # prefix-cache keys of full blocks
    finished: bool = False
    state: int | None = None  # recurrent-state slot while running (models with recurrent layers)
    dropped: int = 0  # leading table entries already checked against the sliding window
    local: list[int] = field(default_factory=list)  # the windowed layers' table (mixed models)
    local_dropped: int = 0  # leading `local` entries already checked against the window

    @property
    def decoding(self) -> bool:
        """Whether only the last token is left to feed (the next step samples after it)."""
        return self.num_computed == len(self.tokens) - 1


@dataclass(frozen=True)
class Work:
    """One scheduled segment of a sequence; `sample` when its last token gives the next one."""

    seq: Sequence
    start: int
    end: int

    @property
    def sample(self) -> bool:
        """Whether this segment reaches the sequence's last token (its logits are needed)."""
        return self.end == len(self.seq.tokens)

    def segment(self) -> Segment:
        """The segment as the paged cache sees it."""
        return Segment(tuple(self.seq.blocks), self.start, self.end, self.seq.state,
                       tuple(self.seq.local))  # fmt: skip


class Scheduler:
    """The waiting and running queues over one block pool."""

    def __init__(
        self,
        pool: BlockPool,
        *,
        max_num_seqs: int,
        max_tokens_per_step: int,
        prefill_chunk: int,
        prefix_caching: bool,
        states: StatePool | None = None,
        window: int | None = None,
        local: WindowBlocks | None = None,
    ) -> None:
        self.pool = pool
        self.local = local  # the windowed layers' blocks of a mixed model
        self.states = states
        self.window = window  # the widest sliding window when every attention layer has one
        self.max_num_seqs = max_num_seqs
        self.budget = max_tokens_per_step
        self.chunk = prefill_chunk
        self.prefix_caching = prefix_caching
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in arrival order
        self.preemptions = 0
        self.prefix_hits = 0  # prompt tokens found in the prefix cache

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence behind the waiting ones."""
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out (finished, cancelled or failed) and release its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.pool.release(seq.blocks)
        seq.blocks = []
        if self.local is not None:
            self.local.release(seq)
        self._drop_state(seq)

    def _drop_state(self, seq: Sequence) -> None:
        if seq.state is not None:
            assert self.states is not None
            self.states.release(seq.state)
            seq.state = None

    def start_state(self, seq: Sequence) -> None:
        """Give a sequence entering the running list its (zeroed) recurrent-state slot."""
        if self.states is not None and seq.state is None:
            seq.state = self.states.allocate()

    def schedule(self) -> list[Work]:
        """The segments of the next step (empty when nothing can run)."""
        work: list[Work] = []
        budget = self.budget
        scheduled: set[int] = set()
        for seq in list(self.running):
            if seq not in self.running or not seq.decoding:
                continue  # preempted by an older one just now, or still prefilling
            if not self._grow(seq, seq.num_computed + 1, scheduled):
                continue  # seq itself was preempted
            work.append(Work(seq, seq.num_computed, seq.num_computed + 1))
            scheduled.add(id(seq))
            budget -= 1
        prefilling = [s for s in self.running if not s.decoding]
        for seq in prefilling:
            budget = self._prefill(seq, budget, work)
            if budget <= 0:
                return work
        while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            if not self._admit(seq):
                break
            before = len(work)
            budget = self._prefill(seq, budget, work)
            if len(work) == before:
                break
        if not work and len(self.running) > 1:
            # Prefills holding blocks that none of them can extend: make room by recompute.
            self._preempt(self.running[-1])
            return self.schedule()
        return work

    def _chunks(self, seq: Sequence, budget: int, allow_over: bool) -> list[tuple[int, int]]:
        """Whole chunks of seq's remaining tokens that fit the budget (and the free blocks)."""
        out = []
        pos = seq.num_computed
        free = self.pool.available
        have = len(seq.blocks)
        bs = self.pool.block_size
        while pos < len(seq.tokens):
            end = min(len(seq.tokens), (pos // self.chunk + 1) * self.chunk)
            need = -(-end // bs) - have
            over_budget = end - pos > budget and not (allow_over and not out)
            if over_budget or need > free:
                break
            out.append((pos, end))
            budget -= end - pos
            free -= max(0, need)
            have += max(0, need)
            pos = end
        return out

    def _prefill(self, seq: Sequence, budget: int, work: list[Work]) -> int:
        """Schedule as many of seq's prefill chunks as fit; the remaining budget.

        The step's first prefill chunk may overrun the budget, so decoding never starves it.
        """
        first = all(w.seq.decoding and w.end - w.start == 1 for w in work)
        chunks = self._chunks(seq, budget, allow_over=first)
        if chunks:
            self._grow(seq, chunks[-1][1], None)
        for start, end in chunks:
            work.append(Work(seq, start, end))
            budget -= end - start
        return budget

    def _grow(self, seq: Sequence, end: int, scheduled: set[int] | None) -> bool:
        """Give seq the blocks for tokens [0, end), preempting the newest (decode) if needed."""
        n_blocks = -(-end // self.pool.block_size)
        need = n_blocks - len(seq.blocks)
        local = self.local
        while need > self.pool.available or (
            local is not None and local.needs(seq, n_blocks) > local.pool.available
        ):
            if scheduled is None:
                return False
            victim = next((s for s in reversed(self.running) if id(s) not in scheduled), None)
            if victim is None:
                return False
            self._preempt(victim)
            if victim is seq:
                return False
        for _ in range(need):
            seq.blocks.append(self.pool.allocate())
        if local is not None:
            local.grow(seq, n_blocks)
        return True

    def reserve(self, seq: Sequence, end: int) -> bool:
        """Give seq the blocks for tokens [0, end) from free ones only; False if too few."""
        return self._grow(seq, end, None)

    def trim(self, seq: Sequence) -> None:
        """Release seq's blocks beyond its tokens (those reserved for rejected drafts)."""
        keep = -(-len(seq.tokens) // self.pool.block_size)
        if len(seq.blocks) > keep:
            self.pool.release(seq.blocks[keep:])
            del seq.blocks[keep:]
        if self.local is not None and len(seq.local) > keep:
            self.local.release(seq, keep)

    def _preempt(self, seq: Sequence) -> None:
        """Free seq's blocks and put it at the head of the waiting queue, to be recomputed."""
        self.running.remove(seq)
        self.pool.release(seq.blocks)
        seq.blocks, seq.num_computed, seq.registered, seq.dropped = [], 0, 0, 0
        if self.local is not None:
            self.local.release(seq)
        self._drop_state(seq)
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def _admit(self, seq: Sequence) -> bool:
        """Move the first waiting sequence to running if its first chunk fits the pool."""
        hit: list[int] = []
        if self.prefix_caching and not seq.blocks:
            # The last token always runs: its logits give the next token.
            full = (len(seq.tokens) - 1) // self.pool.block_size
            hit = self.pool.lookup(self.keys(seq, full))
            if self.local is not None:  # the windowed group's window before the hit's end too
                n, seq.local = self.local.hit(self.keys(seq, full), len(hit))
                seq.local_dropped = self.local.first_needed(n * self.pool.block_size)
                hit = hit[:n]
            for block in hit:
                self.pool.retain(block)
            seq.blocks = list(hit)
            seq.num_computed = len(hit) * self.pool.block_size
            seq.registered = len(hit)
        if not self._chunks(seq, self.budget, allow_over=True):
            self.pool.release(seq.blocks)
            seq.blocks, seq.num_computed, seq.registered = [], 0, 0
            if self.local is not None:
                self.local.release(seq)
                seq.local_dropped = 0
            return False
        self.prefix_hits += seq.num_computed
        self.waiting.popleft()
        self.start_state(seq)
        self.running.append(seq)
        self.running.sort(key=lambda s: s.arrival)
        return True

    def keys(self, seq: Sequence, n_blocks: int) -> list[BlockKey]:
        """Prefix-cache keys of seq's first n_blocks blocks (kept: tokens never change)."""
        if len(seq.keys) < n_blocks:
            seq.keys = block_keys(seq.tokens, self.pool.block_size, n_blocks)
        return seq.keys[:n_blocks]

    def computed(self, seq: Sequence, n: int) -> None:
        """Record n more computed tokens of seq and register its newly full blocks."""
        seq.num_computed += n
        full = seq.num_computed // self.pool.block_size
        if self.prefix_caching and full > seq.registered:
            for i, key in enumerate(self.keys(seq, full)[seq.registered :], seq.registered):
                if seq.blocks[i] != FREED:
                    self.pool.register(seq.blocks[i], key)
            if self.local is not None:
                self.local.register(seq, self.keys(seq, full), seq.registered)
            seq.registered = full
        if self.window is not None:
            self._drop_out_of_window(seq)
        if self.local is not None:
            self.local.drop(seq)

    def _drop_out_of_window(self, seq: Sequence) -> None:
        """Release the blocks wholly before the window of seq's next query (position
        num_computed sees keys from num_computed - window + 1 on)."""
        assert self.window is not None
        first_needed = seq.num_computed - self.window + 1
        behind = max(0, first_needed) // self.pool.block_size
        for i in range(seq.dropped, behind):
            if seq.blocks[i] != FREED:
                self.pool.release([seq.blocks[i]])
                seq.blocks[i] = FREED
        seq.dropped = max(seq.dropped, behind)
