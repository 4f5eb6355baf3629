"""Pictures of the paged KV cache, for notebooks (`notebooks/`): what the engine holds, drawn.

matplotlib is an optional extra (`pip install -e ".[notebooks]"`) and is imported only when
something is drawn: importing this module needs neither it nor JAX. Every helper reads the engine's
public state and draws it; none decides anything:

- `view(engine)` / `watch(engine)`: a `KVView`, the KV cache manager snapshot a step left (a
  `StepRecord.kv`) with a name and the token texts of every sequence it holds, now or after every
  step;
- `draw_kv(views)`: the paper's Figures 6 and 7, one row per view: the logical blocks of each
  sequence with the physical block its block table maps each to, and the physical pools;
- `draw_sharing_tree(view)`: Figures 8 and 9, the blocks that sequences share as a tree;
- `draw_timeline(records)`: blocks used, cached and free per step, with copy-on-write copies,
  swaps and preemptions (`StepRecord`s);
- `draw_runs(runs)`: KV utilization and running requests per step of several runs side by side;
- `draw_bars(groups)`: grouped bars (systems side by side, e.g. from `bench/results/`);
- `draw_expert_load(routing, num_experts)`: a mixture of experts' routing, tokens per expert per layer
  (`jpaged.device.model.sequence_routing`);
- `sharing_summary(kv)`: blocks held with sharing against blocks held with a private copy each.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Optional

from jpaged.core.kv_cache_manager import NULL_BLOCK_ID, DeviceOps, KVCacheManager, blocks_for, filled_slots, \
    kv_utilization, live_block_table, num_null_blocks

FREE_COLOR = "white"
NULL_COLOR = "0.85"
SHARED_COLOR = "0.55"


@dataclasses.dataclass(frozen=True)
class KVView:
    """One moment of the KV cache, ready to draw.

    kv: the KV cache manager snapshot (immutable: `StepRecord.kv` or `engine.scheduler.block_manager`).
    names: seq_id -> a name: the request id, with `/i` for sample i (or the i-th best beam) of a
      group of several.
    tokens: seq_id -> the text of each token whose K/V is in a slot (the snapshot's `num_tokens`).
    title: what the view shows (e.g. the step).
    ops: the block operations the step applied (copy-on-write, swaps), drawn as a caption.
    """

    kv: KVCacheManager
    names: Mapping[Any, str]
    tokens: Mapping[Any, Sequence[str]]
    title: str = ""
    ops: DeviceOps = DeviceOps()


def view(engine, record=None, title: Optional[str] = None) -> KVView:
    """The engine's KV cache as a step left it (`record`, a `StepRecord`; default: now), with the
    names and token texts of the sequences of every unfinished request (read from the scheduler's
    queues; a token is decoded on its own, so a word split in pieces shows in pieces)."""
    kv = record.kv if record is not None else engine.scheduler.block_manager
    s = engine.scheduler
    names, tokens = {}, {}
    for group in [*s.waiting, *s.running, *s.swapped]:
        for rank, seq in enumerate(group.seqs):
            if not kv.has(seq.seq_id):
                continue
            index = rank if group.params.use_beam_search else seq.sample_index  # beams: best first
            names[seq.seq_id] = group.request_id if len(group.seqs) == 1 else f"{group.request_id}/{index}"
            ids = seq.token_ids[:kv.num_tokens(seq.seq_id)]
            tokens[seq.seq_id] = [engine.tokenizer.decode([t]) for t in ids]
    if title is None:
        title = f"after step {record.index} ({record.kind or 'nothing ran'})" if record is not None else ""
    return KVView(kv, names, tokens, title, record.ops if record is not None else DeviceOps())


def watch(engine) -> list[KVView]:
    """A list that gets `view(engine, record)` after every step from now on (an engine observer;
    `engine.remove_observer(views.observer)` stops it)."""
    views = _Views()
    views.observer = lambda record: views.append(view(engine, record))
    engine.add_observer(views.observer)
    return views


class _Views(list):
    observer: Any = None


def sharing_summary(kv: KVCacheManager, seq_ids: Optional[Sequence] = None) -> dict:
    """Device blocks the running sequences (or `seq_ids`) hold: `held` (distinct blocks in their
    tables: what the pool really spends), `unshared` (the sum of ceil(num_tokens / block_size), less
    the null entries a sliding window released: each with a private copy) and `saved` = 1 - held /
    unshared (0.0 with nothing held)."""
    seq_ids = [s for s in (kv.seq_ids if seq_ids is None else seq_ids) if not kv.is_swapped(s)]
    held = len({b for s in seq_ids for _, b in live_block_table(kv, s)})
    unshared = sum(blocks_for(kv.num_tokens(s), kv.block_size) - num_null_blocks(kv, s) for s in seq_ids)
    return dict(held=held, unshared=unshared, saved=1.0 - held / unshared if unshared else 0.0)


# ---- drawing -------------------------------------------------------------------------------------

def _plt():
    try:
        import matplotlib.pyplot as plt
    except ImportError as e:  # an optional extra
        raise ImportError('jpaged.entrypoints.viz draws with matplotlib: pip install -e ".[notebooks]"') from e
    return plt


def _color(seq_id):
    import matplotlib

    palette = matplotlib.colormaps["tab10"].colors
    return palette[hash(seq_id) % len(palette)]


def _short(text: str, width: int = 7) -> str:
    text = text.replace("\n", "\u21b5")
    return text if len(text) <= width else text[:width - 1] + "\u2026"


def _sorted_seqs(v: KVView) -> list:
    return sorted(v.kv.seq_ids, key=lambda s: (v.names.get(s, str(s)), str(s)))


def _draw_logical(ax, v: KVView, show_tokens: bool) -> None:
    """Each sequence's logical blocks, slots filled, labelled with block table entry (physical id, filled)."""
    kv, bs = v.kv, v.kv.block_size
    seqs = _sorted_seqs(v)
    width = max([len(kv.block_table(s)) for s in seqs] + [1])
    for row, seq_id in enumerate(seqs):
        y = -row * 1.6
        n, table, swapped = kv.num_tokens(seq_id), kv.block_table(seq_id), kv.is_swapped(seq_id)
        num_null = num_null_blocks(kv, seq_id)  # released by a sliding window: drawn empty, "null"
        tokens = v.tokens.get(seq_id, ())
        ax.text(-0.4, y + 0.5, v.names.get(seq_id, str(seq_id)), ha="right", va="center", fontsize=8)
        for j, block_id in enumerate(table):
            x0 = j * (bs + 1)
            for k in range(bs):
                p = j * bs + k
                face = NULL_COLOR if j < num_null else _color(seq_id) if p < n else FREE_COLOR
                ax.add_patch(_rect((x0 + k, y), face, alpha=0.55))
                if show_tokens and p < min(n, len(tokens)):
                    ax.text(x0 + k + 0.5, y + 0.5, _short(tokens[p]), ha="center", va="center", fontsize=5.5)
            label = "null" if j < num_null else f"{'cpu ' if swapped else '#'}{block_id} ({min(bs, n - j * bs)}/{bs})"
            ax.text(x0 + bs / 2, y + 1.08, label, ha="center", va="bottom", fontsize=6.5,
                    color="tab:purple" if swapped else "black")
    ax.set_xlim(-0.2, width * (bs + 1))
    ax.set_ylim(-1.6 * max(len(seqs), 1) + 1, 1.7)
    ax.axis("off")


def _num_device_blocks(kv: KVCacheManager, max_blocks: Optional[int], columns: int) -> int:
    """The device blocks to draw: the first `max_blocks`, by default every row up to the highest
    block id a block table names."""
    if max_blocks is None:
        highest = max((b for s in kv.seq_ids if not kv.is_swapped(s) for _, b in live_block_table(kv, s)),
                      default=0)
        max_blocks = columns * (highest // columns + 1)
    return min(kv.num_blocks, max_blocks)


def _num_cpu_blocks(kv: KVCacheManager, cpu: Optional[bool]) -> int:
    """The CPU blocks to draw: all of them when `cpu`, none when not, else all while any is in use."""
    n = getattr(kv, "num_cpu_blocks", 0)
    if cpu is None:
        cpu = n and kv.num_free_cpu_blocks < n
    return n if cpu else 0


def _draw_pool(ax, v: KVView, show_tokens: bool, max_blocks: Optional[int], columns: int,
               cpu: Optional[bool]) -> None:
    """The device pool (and the CPU pool, see `_num_cpu_blocks`): filled slots coloured by holder."""
    kv, bs = v.kv, v.kv.block_size
    pools = [("device", range(_num_device_blocks(kv, max_blocks, columns)), False)]
    if _num_cpu_blocks(kv, cpu):
        pools.append(("CPU", range(min(kv.num_cpu_blocks, max_blocks or kv.num_cpu_blocks)), True))
    y0 = 0.0
    for name, block_ids, swapped in pools:
        fill = filled_slots(kv, swapped=swapped)
        holders: dict[int, list] = {}
        first_pos: dict[int, tuple] = {}
        for seq_id in kv.seq_ids:
            if kv.is_swapped(seq_id) == swapped:
                for j, b in live_block_table(kv, seq_id):
                    holders.setdefault(b, []).append(seq_id)
                    first_pos.setdefault(b, (seq_id, j))
        ax.text(-0.3, y0 + 0.5, name, ha="right", va="center", fontsize=8, weight="bold")
        for i, block_id in enumerate(block_ids):
            x, y = (i % columns) * (bs + 1), y0 - (i // columns) * 1.6
            is_null = block_id == NULL_BLOCK_ID and not swapped
            owners = holders.get(block_id, [])
            cached = not owners and not swapped and getattr(kv, "is_cached", lambda b: False)(block_id)
            for k in range(bs):
                if is_null:
                    face = NULL_COLOR
                elif k < fill.get(block_id, 0):
                    face = _color(owners[0]) if len(owners) == 1 else SHARED_COLOR
                else:
                    face = "0.93" if cached else FREE_COLOR
                ax.add_patch(_rect((x + k, y), face, alpha=0.55, hatch="//" if is_null else None))
                if show_tokens and owners and k < fill.get(block_id, 0):
                    seq_id, j = first_pos[block_id]
                    tokens = v.tokens.get(seq_id, ())
                    if j * bs + k < len(tokens):
                        ax.text(x + k + 0.5, y + 0.5, _short(tokens[j * bs + k]), ha="center", va="center",
                                fontsize=5.5)
            refs = len(owners)
            label = "null" if is_null else f"{block_id}" + (f" rc={refs}" if refs > 1 else "") + (
                " cached" if cached else "")
            ax.text(x + bs / 2, y + 1.08, label, ha="center", va="bottom", fontsize=6.5,
                    weight="bold" if refs > 1 else "normal")
        y0 -= 1.6 * (-(-len(block_ids) // columns)) + 0.8
        if not swapped and len(block_ids) < kv.num_blocks:
            ax.text(0, y0 + 0.9, f"blocks {len(block_ids)}-{kv.num_blocks - 1} not drawn", fontsize=6.5,
                    color="0.4", va="top")
    ax.set_xlim(-0.2, columns * (bs + 1))
    ax.set_ylim(y0 + 0.6, 1.7)
    ax.axis("off")


def _rect(xy, face, alpha=1.0, hatch=None):
    from matplotlib.patches import Rectangle

    return Rectangle(xy, 1, 1, facecolor=face, edgecolor="0.3", linewidth=0.5, alpha=alpha, hatch=hatch)


def _caption(v: KVView) -> str:
    ops, parts = v.ops, []
    if ops.copy_pairs:
        parts.append("copy-on-write " + ", ".join(f"{a}->{b}" for a, b in ops.copy_pairs))
    if ops.swap_out:
        parts.append("swap out " + ", ".join(f"{a}->cpu {b}" for a, b in ops.swap_out))
    if ops.swap_in:
        parts.append("swap in " + ", ".join(f"cpu {a}->{b}" for a, b in ops.swap_in))
    return v.title + (": " + "; ".join(parts) if parts else "")


def draw_kv(views: KVView | Sequence[KVView], *, show_tokens: Optional[bool] = None,
            max_blocks: Optional[int] = None, columns: int = 4, cpu: Optional[bool] = None):
    """Draws each view as one row (the paper's Figures 6 and 7): on the left every sequence's
    logical blocks, a cell per token slot (filled slots coloured by sequence, with the token's text),
    each block labelled with its block table entry (physical block id, filled slots; `cpu` ids while
    swapped out); on the right the physical pools, `columns` blocks a row: the device pool (block 0,
    the null block, hatched; a block's filled slots coloured by the sequence holding it, grey when
    several share it, with its refcount; free blocks white; cached-free blocks pale) and, when the
    engine has one, the CPU swap pool. The row's title names the step and its copy-on-write and
    swap operations. `show_tokens`: default when blocks are at most 8 slots; `max_blocks`: draw only
    the first blocks of each pool (default: the device pool's rows up to the highest block in a
    table, every CPU block). Returns the figure."""
    plt = _plt()
    views = [views] if isinstance(views, KVView) else list(views)
    if not views:
        raise ValueError("draw_kv: no view to draw")
    bs = views[0].kv.block_size
    show_tokens = bs <= 8 if show_tokens is None else show_tokens
    heights = [max(len(v.kv.seq_ids), 1 + (-(-_num_device_blocks(v.kv, max_blocks, columns) // columns))
                   + (1 + -(-_num_cpu_blocks(v.kv, cpu) // columns) if _num_cpu_blocks(v.kv, cpu) else 0))
               for v in views]
    fig, axes = plt.subplots(len(views), 2, squeeze=False, figsize=(13, sum(0.55 * h + 0.6 for h in heights)),
                             gridspec_kw=dict(height_ratios=heights, width_ratios=(1.1, 1)))
    for row, ((left, right), v) in enumerate(zip(axes, views)):
        _draw_logical(left, v, show_tokens)
        _draw_pool(right, v, show_tokens, max_blocks, columns, cpu)
        left.set_title(_caption(v), loc="left", fontsize=9, weight="bold")
        if row == 0:
            left.set_title("logical blocks; block table: #physical block (filled/slots)", loc="right", fontsize=7)
            right.set_title("physical blocks (grey: shared; rc: refcount)", loc="right", fontsize=7)
    fig.tight_layout()
    return fig


def draw_sharing_tree(v: KVView, seq_ids: Optional[Sequence] = None, ax=None):
    """Draws the blocks of the running sequences (or `seq_ids`) as the tree their sharing makes (the
    paper's Figures 8 and 9): a node per physical block at its logical index (left to right),
    labelled with its id, refcount and the text it holds; an edge from each block to the next one of
    any table holding it; a leaf per sequence, named. Blocks held by one sequence take its colour,
    shared ones are grey. Returns the figure."""
    plt = _plt()
    import matplotlib.colors

    kv = v.kv
    seq_ids = [s for s in (_sorted_seqs(v) if seq_ids is None else seq_ids) if not kv.is_swapped(s)]
    children: dict = {}
    holders: dict = {}
    roots: list = []
    for s in seq_ids:
        table = kv.block_table(s)
        first = num_null_blocks(kv, s)  # a sliding window's null entries are no nodes
        for j, b in live_block_table(kv, s):
            holders.setdefault(b, []).append(s)
            parent = table[j - 1] if j > first else None
            kids = children.setdefault(parent, [])
            if b not in kids:
                kids.append(b)
        children.setdefault(("leaf", table[-1]), [])
    roots = children.get(None, [])
    ys, next_y = {}, [0.0]

    def place(b):
        kids = children.get(b, [])
        leaves = [s for s in seq_ids if kv.block_table(s)[-1] == b]
        if not kids:
            ys[b] = next_y[0] + (max(len(leaves), 1) - 1) / 2
            next_y[0] += max(len(leaves), 1)
        else:
            for k in kids:
                place(k)
            ys[b] = sum(ys[k] for k in kids) / len(kids)
        return ys[b]

    for r in roots:
        place(r)
    if ax is None:
        fig, ax = plt.subplots(figsize=(12, 1.0 + 0.55 * max(next_y[0], 1)))
    else:
        fig = ax.figure
    bs = kv.block_size
    depth = {}
    for s in seq_ids:
        for j, b in live_block_table(kv, s):
            depth[b] = j
    for b, y in ys.items():
        x = depth[b] * 3.0
        for k in children.get(b, []):
            ax.plot([x, depth[k] * 3.0], [-y, -ys[k]], color="0.4", lw=0.8, zorder=1)
        owners = holders[b]
        first = owners[0]
        j = depth[b]
        text = "".join(v.tokens.get(first, ())[j * bs:(j + 1) * bs])
        face = _color(first) if len(owners) == 1 else SHARED_COLOR
        face = tuple(0.5 + 0.5 * float(c) for c in matplotlib.colors.to_rgb(face))  # opaque, pale
        ax.text(x, -y, f"#{b} rc={len(owners)}\n{_short(text, 18)}", ha="center", va="center", fontsize=6.5,
                bbox=dict(boxstyle="round", facecolor=face), zorder=2)
    for s in seq_ids:
        last = kv.block_table(s)[-1]
        same = [q for q in seq_ids if kv.block_table(q)[-1] == last]
        y = ys[last] + same.index(s) - (len(same) - 1) / 2
        ax.plot([depth[last] * 3.0, depth[last] * 3.0 + 1.5], [-ys[last], -y], ":", color="0.6", lw=0.8, zorder=0)
        ax.text(depth[last] * 3.0 + 1.6, -y, v.names.get(s, str(s)), ha="left", va="center", fontsize=8,
                color=_color(s))
    ax.set_xlim(-1.6, max(depth.values(), default=0) * 3.0 + 3.5)
    ax.set_ylim(-max(next_y[0], 1), 1)
    ax.set_title(v.title or "block sharing", fontsize=9)
    ax.axis("off")
    fig.tight_layout()
    return fig


def draw_timeline(records: Sequence, ax=None, title: str = ""):
    """Draws, per step (`StepRecord`s), the device blocks used, cached-free and free (stacked) and
    the CPU blocks in use (a line), with markers for the step's copy-on-write copies (x), blocks
    swapped out (v) and in (^), and preemptions (red lines). Returns the figure."""
    plt = _plt()
    if ax is None:
        fig, ax = plt.subplots(figsize=(11, 3.6))
    else:
        fig = ax.figure
    steps = [r.index for r in records]
    stats = [r.kv.stats() for r in records]
    used = [s["num_used_blocks"] for s in stats]
    cached = [s["num_cached_free_blocks"] for s in stats]
    free = [s["num_free_blocks"] - c for s, c in zip(stats, cached)]
    ax.stackplot(steps, used, cached, free, labels=["used", "cached (free)", "free"],
                 colors=["tab:green", "tab:olive", "0.9"], step="post", alpha=0.8)
    if any(s["num_cpu_blocks"] for s in stats):
        ax.step(steps, [s["num_used_cpu_blocks"] for s in stats], where="post", color="tab:purple",
                label="CPU blocks in use")
    top = records[0].kv.num_blocks - 1 if records else 1
    for marker, key, label in (("x", "copy_pairs", "copy-on-write"), ("v", "swap_out", "swapped out"),
                               ("^", "swap_in", "swapped in")):
        points = [(r.index, len(getattr(r.ops, key))) for r in records if getattr(r.ops, key)]
        if points:
            ax.scatter([p[0] for p in points], [top * 1.04] * len(points), marker=marker,
                       s=[20 + 12 * p[1] for p in points], label=f"{label} (size: blocks)", zorder=3)
    for r in records:
        if r.preempted:
            ax.axvline(r.index, color="tab:red", lw=1, alpha=0.7)
    if any(r.preempted for r in records):
        ax.plot([], [], color="tab:red", label="preemption")
    ax.set_xlabel("engine step")
    ax.set_ylabel("device blocks")
    ax.set_ylim(0, top * 1.1)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    ax.set_title(title or "KV blocks per step", fontsize=9)
    fig.tight_layout()
    return fig


def draw_runs(runs: Mapping[str, Sequence]):
    """Draws several runs' `StepRecord`s side by side: KV utilization per step (token slots holding
    K/V over the slots of the blocks in use or reserved, `jpaged.core.kv_cache_manager.kv_utilization`),
    requests running per step, and the output tokens per step (the mean batch: a clock-free measure
    of throughput, where tokens per second would depend on the machine and what else runs on it).
    Returns the figure."""
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.6), gridspec_kw=dict(width_ratios=(2, 2, 1)))
    rates = {}
    for name, records in runs.items():
        steps = [r.index for r in records]
        utilization = [kv_utilization(r.kv) for r in records]
        axes[0].step(steps, [100 * u if u is not None else float("nan") for u in utilization], where="post",
                     label=name)
        axes[1].step(steps, [r.num_running for r in records], where="post", label=name)
        num_steps = sum(r.kind is not None for r in records)
        rates[name] = sum(r.num_sampled_tokens for r in records) / num_steps if num_steps else 0.0
    axes[0].set_ylabel("KV utilization (%)")
    axes[0].set_ylim(0, 105)
    axes[1].set_ylabel("requests running")
    for ax in axes[:2]:
        ax.set_xlabel("engine step")
        ax.legend(fontsize=7)
    axes[2].bar(list(rates), list(rates.values()), color=[f"C{i}" for i in range(len(rates))])
    axes[2].set_ylabel("output tokens per step")
    axes[2].tick_params(axis="x", labelsize=7, rotation=30)
    fig.tight_layout()
    return fig


def draw_bars(groups: Mapping[str, Mapping[str, float]], *, ylabel: str = "", title: str = "",
              percent: bool = False, ax=None):
    """Grouped bars: a group per key of `groups` (e.g. a trace), a bar per system in it (the same
    systems in the same colours across groups), each bar labelled with its value (`percent`:
    values are fractions, drawn as %). Returns the figure."""
    plt = _plt()
    if ax is None:
        fig, ax = plt.subplots(figsize=(max(5.0, 1.6 * len(groups) + 3), 3.6))
    else:
        fig = ax.figure
    systems = list(dict.fromkeys(s for g in groups.values() for s in g))
    width = 0.8 / max(len(systems), 1)
    for i, system in enumerate(systems):
        xs = [g + (i - (len(systems) - 1) / 2) * width for g in range(len(groups))]
        values = [groups[name].get(system, float("nan")) * (100 if percent else 1) for name in groups]
        bars = ax.bar(xs, values, width, label=system, color=f"C{i}")
        ax.bar_label(bars, fmt="%.1f" if percent else "%.3g", fontsize=6.5)
    ax.set_xticks(range(len(groups)), list(groups), fontsize=8)
    ax.set_ylabel(ylabel + (" (%)" if percent else ""))
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def expert_load(routing: Sequence, num_experts: int):
    """Tokens routed to each expert in each layer, i64[layers, num_experts], from `sequence_routing`'s
    i32[layers, tokens, k] per sequence (a token counts once for each of its k experts)."""
    import numpy as np

    counts = None
    for r in routing:
        r = np.asarray(r)
        one = np.stack([np.bincount(layer.reshape(-1), minlength=num_experts) for layer in r])
        counts = one if counts is None else counts + one
    return counts


def draw_expert_load(routing: Sequence, num_experts: int, *, title: str = "", ax=None):
    """A heat map of `expert_load`: a row per layer, a column per expert, each cell the tokens routed there
    (an expert no token chose is a 0 cell). Returns the figure."""
    plt = _plt()
    counts = expert_load(routing, num_experts)
    if ax is None:
        fig, ax = plt.subplots(figsize=(max(5.0, 0.25 * num_experts + 2), 0.45 * len(counts) + 1.6))
    else:
        fig = ax.figure
    image = ax.imshow(counts, aspect="auto", cmap="viridis")
    ax.set_xlabel("expert")
    ax.set_ylabel("layer")
    ax.set_yticks(range(len(counts)))
    ax.set_title(title or f"tokens per expert per layer ({int(counts[0].sum())} routed a layer)", fontsize=9)
    fig.colorbar(image, ax=ax, label="tokens")
    fig.tight_layout()
    return fig
