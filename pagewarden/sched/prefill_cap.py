"""How many prefill tokens a step may carry beside the streams it decodes.

Every token a step prefills delays the streams that decode in it: a step that prefills a
group of prompts takes many decode steps' time, and the gaps it puts in every decoding
stream are the inter-token latency tail (one such step per group is the price of
starting the group; ``bench/serve.py`` measures it). With ``D`` the requests that
decode this step, ``c`` half of ``D`` rounded up to whole KV blocks, and ``W`` the prefill
work pending (the uncomputed tokens of running requests still prefilling and of waiting
ones, before any prefix-cache hit):

- **Small work is chunked.** When ``W`` fits in ``k = min(MAX_CHUNK_STEPS, D)`` chunks of
  ``c`` tokens, the step prefills at most ``c``: it grows by about half a decode step's
  tokens, so a lone request arriving while many streams decode stalls none of them, and
  starts within ``k`` steps. Chunking costs the newcomer a step per chunk and spares each
  of the ``D`` streams one stall, so it is done for no more chunks than ``D``.
- **A group gets the whole token budget, and group steps are ``GROUP_SPACING_STEPS``
  steps apart.** A burst of prompts is prefilled as vLLM does it, in full steps, so each
  stall is shared by many prompts. A group step is not taken within
  ``GROUP_SPACING_STEPS`` steps of the last one (meanwhile the work is chunked at ``c``):
  the streams a group step started are then that many tokens ahead of the next group, so
  when they finish and come back (a closed-loop client sends its next requests) their
  prefill step is over before the next group comes back, and neither waits behind the
  other's. Two groups started in back-to-back steps finish one step apart and keep
  colliding: every round, the second waits out the first's whole prefill step before its
  own. The spacing must exceed the steps a returning group takes to arrive (its
  requests reach a busy engine over 100-300 ms, 4-10 steps, while the other group keeps
  decoding and so closes the gap): at 8 the other group finished during the first's
  prefill step every round and then waited out the rest of the spacing (150-230 ms of
  its time to first token); at 16 it is still decoding when that step ends and comes
  back near the end of the spacing (traced: still 130-270 ms after its last request).
- **A part-filled group waits for more work** while at least ``MAX_CHUNK_STEPS``
  streams decode. Group work that leaves room in a step for another piece as small as
  its smallest (``W + m <= budget - D``, ``m`` the fewest tokens one pending request
  still needs) is chunked at ``c`` while it is under half a step (``W < (budget - D) /
  2``) or still growing (``W`` rose in the last ``QUIET_STEPS`` steps: its requests are
  still arriving), until it has waited ``2 * MAX_CHUNK_STEPS`` steps. Each group step
  stalls every decoding stream once, and the inter-token p99 is decided by whether
  those stalls pass 1% of all gaps: a burst split into a small group and a remainder
  would cost a stall per part, in every round. Waiting lets the small part join the
  next group, so the groups settle into full steps; and a group whose requests trickle
  in (a closed-loop client's next requests reach a busy engine over 100-300 ms: the
  HTTP process shares the cores with the steps) starts once, when they have come, not
  half now and half in a second stall.

The spacing and the wait apply while at least ``MAX_CHUNK_STEPS`` streams decode: with
fewer, a group step stalls few streams and pacing would only delay it; with nothing
decoding nobody is stalled at all. Both get the whole budget (a group step). The cap
only ever lowers a step below ``max_num_batched_tokens``, which keeps vLLM's meaning
(decode tokens count in it).

    first match, top down (s: steps since the last group step,
    w: steps since group-sized work started waiting)           this step's prefill cap
    D = 0                                                      budget (a group step)
    W <= min(MAX_CHUNK_STEPS, D) * c                           c        (small work)
    D < MAX_CHUNK_STEPS                                        budget (a group step)
    s < GROUP_SPACING_STEPS                                    c        (spacing)
    W + m > budget - D  or  w >= 2 * MAX_CHUNK_STEPS           budget (a group step)
    W >= (budget - D) / 2  and  W did not grow in QUIET_STEPS  budget (a group step)
    otherwise                                                  c        (waits for more)
"""

from __future__ import annotations

from pagewarden.sched.state import SchedulerState

__all__ = ["GROUP_SPACING_STEPS", "MAX_CHUNK_STEPS", "QUIET_STEPS", "prefill_cap"]

#: Small work is chunked over at most this many steps (a bound on what chunking adds to a
#: time to first token); spacing and waiting apply while at least this many streams decode.
MAX_CHUNK_STEPS = 8
#: Group steps are at least this many steps apart while streams decode (the module's
#: docstring says why 16: more than a returning group's arrival takes).
GROUP_SPACING_STEPS = 16
#: Group work over half a step but short of a full one starts once it has not grown for
#: this many steps (a closed-loop client's requests trickle in over a few steps).
QUIET_STEPS = 2


def prefill_cap(sched: SchedulerState) -> int:
    """The most prefill tokens ``sched``'s step ``num_steps`` may schedule (at most its
    token budget); records a group step in ``last_group_step``, when group-sized work
    started waiting in ``group_wait_since``, the work pending in ``group_wait_work`` and
    the last step it grew in ``group_grew_at``. Running requests count in order up to
    ``max_num_seqs`` (the ones a step can take), a request one token behind as a decode;
    waiting ones count only while a seat is free (otherwise none can start)."""
    budget = sched.max_num_batched_tokens
    num_decodes = pending = 0
    smallest = budget  # the smallest piece of pending work
    for i, req in enumerate(sched.running):
        gap = req.num_computable_tokens - req.num_computed_tokens
        if gap == 1 and i < sched.max_num_seqs:
            num_decodes += 1
        elif gap > 1:
            pending += gap
            smallest = min(smallest, gap)
    block_size = sched.config.block_size
    cap = -(-num_decodes // 2 // block_size) * block_size  # half the decodes, whole blocks
    limit = min(MAX_CHUNK_STEPS, num_decodes) * cap
    full_step = budget - num_decodes
    seats = len(sched.running) < sched.max_num_seqs
    for req in sched.waiting if seats else ():  # stops past both bounds (queues can be long)
        if pending > max(limit, full_step):
            break
        gap = req.num_computable_tokens - req.num_computed_tokens
        pending += gap
        smallest = min(smallest, gap)
    now = sched.num_steps
    if pending > sched.group_wait_work:
        sched.group_grew_at = now
    sched.group_wait_work = pending
    if pending == 0 or (pending <= limit and num_decodes > 0):
        sched.group_wait_since = None  # no group-sized work waits
        return budget if pending == 0 else min(cap, budget)  # nothing, or small work
    if num_decodes < MAX_CHUNK_STEPS:
        return _group_step(sched, budget)  # none or few streams to stall: no pacing
    last = sched.last_group_step
    if sched.group_wait_since is None:
        sched.group_wait_since = now
    if last is not None and now - last < GROUP_SPACING_STEPS:
        return min(cap, budget)  # spacing
    if pending + smallest > full_step or now - sched.group_wait_since >= 2 * MAX_CHUNK_STEPS:
        return _group_step(sched, budget)  # no room for more such work, or waited enough
    if pending >= full_step // 2 and now - sched.group_grew_at >= QUIET_STEPS:
        return _group_step(sched, budget)  # over half a step, and nothing more came
    return min(cap, budget)  # a part-filled group waits for more work


def _group_step(sched: SchedulerState, budget: int) -> int:
    """Record a full-budget step (``num_steps``) and return its budget."""
    sched.last_group_step = sched.num_steps
    sched.group_wait_since = None
    return budget
