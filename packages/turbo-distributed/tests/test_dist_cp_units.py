"""Context-parallel pieces in one process: input splitting, K/V replication, validation."""

import pytest
import torch
from torch import nn

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.model_facts import ModelFactsConfig, plain_api_facts, resolve_model_facts
from fsdp_turbo.core.testing.models import tiny_hf_causal_lm
from fsdp_turbo.distributed.context_parallel import CPState, resolve_cp_target
from fsdp_turbo.distributed.context_parallel.inputs import split_inputs
from fsdp_turbo.distributed.context_parallel.transform import plan_context_parallel
from fsdp_turbo.distributed.context_parallel.ulysses import full_causal_mask, replicate_kv, replicated_kv_heads
from fsdp_turbo.fsdp_turbo_config import CPPlanConfig

pytest.importorskip("transformers")


def _split(rank, cp=4, **kwargs):
    state = CPState(group=None, size=cp, rank=rank)
    return split_inputs(state, kwargs), state.current


def test_split_shifts_pads_and_cuts_each_rank_its_chunk():
    ids = torch.arange(10).reshape(1, 10) + 100
    labels = ids.clone()
    labels[0, 3] = -100
    chunks = [_split(r, input_ids=ids, labels=labels) for r in range(4)]
    # Padded to 12: 3 tokens a rank; the two padding ids are 0, positions continue.
    assert torch.cat([c["input_ids"] for c, _ in chunks], 1).tolist() == [[*range(100, 110), 0, 0]]
    assert torch.cat([c["position_ids"] for c, _ in chunks], 1).tolist() == [list(range(12))]
    shifted = torch.cat([c["shift_labels"] for c, _ in chunks], 1)[0].tolist()
    assert shifted == [101, 102, -100, 104, 105, 106, 107, 108, 109, -100, -100, -100]
    assert all(int(c["num_items_in_batch"]) == 8 for c, _ in chunks)  # the whole sequence's count
    assert all(c["labels"] is c["shift_labels"] for c, _ in chunks)
    assert chunks[0][1].seq_len == 12 and chunks[0][1].padding_mask is None


def test_all_ignored_sequence_counts_one_not_zero():
    ids = torch.ones(1, 8, dtype=torch.long)
    out, _ = _split(0, cp=2, input_ids=ids, labels=torch.full_like(ids, -100))
    assert int(out["num_items_in_batch"]) == 1


def test_padding_mask_is_kept_whole_for_attention():
    ids = torch.ones(2, 6, dtype=torch.long)
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, -2:] = 0
    out, context = _split(1, cp=2, input_ids=ids, attention_mask=mask)
    assert out["attention_mask"] is None and context.padding_mask.shape == (2, 6)
    allowed = full_causal_mask(6, context.padding_mask, torch.float32, torch.device("cpu"), additive=False)
    assert allowed.shape == (2, 1, 6, 6) and not allowed[1, 0, 5, 4] and allowed[0, 0, 5, 4]
    additive = full_causal_mask(6, None, torch.float32, torch.device("cpu"), additive=True)
    assert additive[0, 0, 0, 1] == torch.finfo(torch.float32).min and additive[0, 0, 1, 0] == 0


def test_packed_documents_keep_attention_inside_each_document():
    # Two rows of 7: documents of 3 + 4 tokens, and one document; padded to 8 for cp=2.
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3], list(range(7))])
    _, context = _split(0, cp=2, input_ids=torch.ones(2, 7, dtype=torch.long), position_ids=positions)
    assert context.documents.tolist() == [[0, 0, 0, 1, 1, 1, 1, 1], [0] * 8]
    allowed = full_causal_mask(8, None, torch.float32, torch.device("cpu"), additive=False,
                               documents=context.documents)
    assert allowed[0, 0, 4, 3] and not allowed[0, 0, 3, 2] and not allowed[0, 0, 2, 3]
    assert allowed[1, 0].equal(torch.ones(8, 8, dtype=torch.bool).tril())
    _, plain = _split(0, cp=2, input_ids=torch.ones(1, 8, dtype=torch.long))
    assert plain.documents is None  # one document a row: is_causal suffices


def test_kv_replication_keeps_each_query_head_on_its_kv_head():
    assert replicated_kv_heads(2, 4) == 4 and replicated_kv_heads(8, 4) == 8 and replicated_kv_heads(6, 4) == 12
    kv = torch.arange(2).reshape(1, 2, 1, 1).float()
    assert replicate_kv(kv, 4).flatten().tolist() == [0, 0, 1, 1]


def test_validation():
    def target(model, **facts):
        return resolve_cp_target(model, None, resolve_model_facts(model, ModelFactsConfig(**facts)))

    assert target(tiny_hf_causal_lm("llama")).hf_implementation == "sdpa"
    with pytest.raises(ConfigError, match="no recognisable attention"):
        target(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(ConfigError, match="does not import"):
        target(nn.Linear(2, 2), attention_function="torch.no_such_attention")
    flex = tiny_hf_causal_lm("llama")
    flex.config._attn_implementation = "flex_attention"
    with pytest.raises(ConfigError, match="cannot take the place"):
        target(flex)


@pytest.mark.parametrize("kind, declared, why", [
    ("kimi_linear", "kimi_delta_attention", "carries a state along the sequence"),
    ("deepseek_v32", "indexed_attention", "indexer picks each query's keys"),
    ("glm_moe_dsa", "indexed_attention", "indexer picks each query's keys"),
    ("deepseek_v4", "compressed_sparse_attention", "compressed entries come from the whole sequence"),
])
@pytest.mark.parametrize("mode", ["ring", "hybrid"])
def test_layers_only_ulysses_computes_are_refused_by_name_for_a_ring(kind, declared, why, mode):
    model = tiny_hf_causal_lm(kind)
    plan = CPPlanConfig(mode=mode, **({"ulysses_size": 2} if mode == "hybrid" else {}))
    with pytest.raises(ConfigError, match="mode: ulysses") as error:
        plan_context_parallel(model, plan, 4, plain_api_facts(model))
    assert error.value.field == "cp_plan.mode" and why in str(error.value), str(error.value)
    assert declared in str(error.value) or "linear" in str(error.value), str(error.value)
    ulysses = plan_context_parallel(model, CPPlanConfig(mode="ulysses"), 2, plain_api_facts(model))
    kinds = {row.kind for row in ulysses.describe()}
    assert kinds & {"linear", "sparse", "compressed"}, kinds


def test_a_layer_of_an_unknown_kind_is_refused_in_every_mode():
    from fsdp_turbo.core.families import AttentionKind, Family, LayerKind, register_family, unregister_family

    model = tiny_hf_causal_lm("llama")
    model.config.model_type = "llama-with-a-new-mixer"
    register_family(Family(name="new-mixer", model_types=("llama-with-a-new-mixer",),
                           layer_kinds=lambda config, layers: (LayerKind(AttentionKind.UNKNOWN, declared="mixer"),)
                           * layers))
    try:
        for mode in ("ulysses", "ring"):
            with pytest.raises(ConfigError, match="is a mixer layer: context parallel does not know") as error:
                plan_context_parallel(model, CPPlanConfig(mode=mode), 2, plain_api_facts(model))
            assert error.value.field == "context_parallel_size"
    finally:
        unregister_family("new-mixer")


def test_zigzag_tiles_one_kernel_call_per_off_diagonal_block():
    """Zig-zag at CP=4: the own block is a causal tile per chunk plus the full one between
    them (rank 3's chunks 3 and 4 are adjacent: one causal tile); every other block is one
    full tile (its two full halves joined); together exactly the pairs causal attention needs."""
    from fsdp_turbo.distributed.context_parallel.blocks import ring_tiles
    from fsdp_turbo.distributed.context_parallel.context import ForwardContext
    from fsdp_turbo.distributed.context_parallel.ring_math import chunk_positions

    positions = [chunk_positions(32, 4, r, True) for r in range(4)]
    for rank in range(4):
        blocks = ring_tiles(ForwardContext(32, ring_positions=positions), rank, torch.device("cpu"))
        own = 1 if rank == 3 else 3
        assert [len(tiles) for tiles in blocks] == [own if source == rank else 1 for source in range(4)]
        pairs = set()
        for source, tiles in enumerate(blocks):
            for tile in tiles:
                q, k = positions[rank][tile.q], positions[source][tile.k]
                pairs |= {(int(a), int(b)) for a in q for b in k if not tile.causal or b <= a}
        assert pairs == {(a, b) for a in positions[rank].tolist() for b in range(32) if b <= a}


def test_a_sliding_window_skips_the_tiles_out_of_reach():
    """Contiguous chunks of 8 at CP=4, a window of 4: each rank's queries see only its own
    chunk (causal, the window cutting its lower corner: one masked tile) and the previous
    rank's last 3 keys (one masked tile); the two blocks further back are skipped. Together
    the tiles cover exactly the pairs the window allows."""
    from fsdp_turbo.distributed.context_parallel.blocks import ring_tiles
    from fsdp_turbo.distributed.context_parallel.context import ForwardContext
    from fsdp_turbo.distributed.context_parallel.ring_math import chunk_positions

    positions = [chunk_positions(32, 4, r, False) for r in range(4)]
    for rank in range(4):
        blocks = ring_tiles(ForwardContext(32, ring_positions=positions), rank, torch.device("cpu"), window=4)
        assert [len(tiles) for tiles in blocks] == [int(source in (rank, rank - 1)) for source in range(4)]
        pairs = set()
        for source, tiles in enumerate(blocks):
            for tile in tiles:
                q, k = positions[rank][tile.q], positions[source][tile.k]
                allowed = tile.mask[0, 0] if tile.mask is not None else torch.ones(len(q), len(k), dtype=torch.bool)
                pairs |= {(int(a), int(b)) for i, a in enumerate(q) for j, b in enumerate(k)
                          if allowed[i, j] and (not tile.causal or b <= a)}
        assert pairs == {(a, b) for a in positions[rank].tolist() for b in range(32) if 0 <= a - b < 4}


def _coverage(blocks, positions, rank, seq):
    """How many times each (query of this rank, key position) pair is computed, and the pairs
    the kernels compute (a causal square: half)."""
    rows = torch.arange(positions[rank].numel())
    covered = torch.zeros(rows.numel(), seq, dtype=torch.int)
    pairs = 0.0
    for source, tiles in enumerate(blocks):
        for tile in tiles:
            q, k = rows[tile.q], positions[source][tile.k]
            part = torch.ones(len(q), len(k), dtype=torch.bool) if tile.mask is None else tile.mask[0, 0]
            if tile.causal:
                part = part.triu() if tile.reverse else part.tril()
            covered[q[:, None], k[None, :]] += part.int()
            pairs += len(q) * len(k) / (2 if tile.causal else 1)  # flash kernels skip a causal square's half
    return covered, pairs


@pytest.mark.parametrize("whole", [False, True], ids=["up to three tiles a block", "whole blocks"])
@pytest.mark.parametrize("name", ["window", "documents", "chunk", "causal", "causal zig-zag", "window zig-zag"])
def test_the_block_map_computes_what_the_mask_keeps(name, whole):
    """Sequence 4096 over 4 ranks (the issue's case), the default blocks of 64 query rows: every
    kept pair is computed exactly once, none outside the mask, and the pairs computed are at most
    1.25 times the pairs kept plus one block (64 x 64) per 64 query rows, whether a cut block's
    keys are split into up to three tiles (a causal square counting half) or computed as one
    masked tile (``whole_blocks``, CPU's). A 128-token window or 16 packed documents of 256 then
    cost each rank about 1/16 of its causal work."""
    from fsdp_turbo.distributed.context_parallel.blocks import DEFAULT_BLOCK, ring_tiles
    from fsdp_turbo.distributed.context_parallel.context import ForwardContext
    from fsdp_turbo.distributed.context_parallel.ring_math import chunk_positions, visible

    seq, cp, block = 4096, 4, DEFAULT_BLOCK
    positions = [chunk_positions(seq, cp, r, "zig-zag" in name) for r in range(cp)]
    documents = torch.arange(seq)[None] // 256 if name == "documents" else None
    window = 128 if name.startswith("window") else None
    chunk = 1000 if name == "chunk" else None
    index = torch.arange(seq)
    allowed = visible(index, index, documents, documents, window=window)[0, 0]
    if chunk:
        allowed &= (index // chunk)[:, None] == (index // chunk)[None, :]
    for rank in range(cp):
        context = ForwardContext(seq, documents=documents, ring_positions=positions)
        blocks = ring_tiles(context, rank, torch.device("cpu"), window, chunk, block=block, whole_blocks=whole)
        covered, pairs = _coverage(blocks, positions, rank, seq)
        kept = allowed[positions[rank]]
        assert covered.max() <= 1
        assert torch.equal(covered.bool(), kept)
        rows = positions[rank].numel()
        assert pairs <= 1.25 * int(kept.sum()) + rows * block, (rank, pairs, int(kept.sum()))


def test_a_window_ships_only_the_rows_it_reaches():
    """Contiguous chunks of 1024 and a 128-token window: the next rank sees the last 127 rows
    of each chunk, so only those travel (the last rank's chunk: nobody else's, one row). Zig-zag
    under causal: a rank's second chunk (the sequence's later half) is seen by the ranks whose
    second chunks come later, so rank 0 (chunks 0 and 7) ships only its first chunk."""
    from fsdp_turbo.distributed.context_parallel.blocks import shipped_rows
    from fsdp_turbo.distributed.context_parallel.ring_math import chunk_positions

    contiguous = [chunk_positions(4096, 4, r, False) for r in range(4)]
    assert shipped_rows(contiguous, 128) == [slice(897, 1024)] * 3 + [slice(1023, 1024)]
    assert shipped_rows(contiguous, None) == [slice(0, 1024)] * 3 + [slice(1023, 1024)]
    zigzag = [chunk_positions(4096, 4, r, True) for r in range(4)]
    assert shipped_rows(zigzag, None) == [slice(0, 512), slice(0, 1024), slice(0, 1024), slice(0, 1024)]


def test_packed_documents_shorten_the_ring_and_its_sends():
    """Documents of 256 tokens over contiguous chunks of 1024: no query sees another rank's keys,
    so the ring takes one step and nothing needs to travel; documents of 1536 (starting at 0, 1536
    and 3072) reach one rank back: rank 1 sees all of rank 0's chunk, rank 2 rank 1's rows from
    1536 on, rank 3 (a document of its own) nothing of rank 2's (one row ships)."""
    from fsdp_turbo.distributed.context_parallel.blocks import ring_steps, shipped_rows
    from fsdp_turbo.distributed.context_parallel.context import ForwardContext
    from fsdp_turbo.distributed.context_parallel.ring_math import chunk_positions

    positions = [chunk_positions(4096, 4, r, False) for r in range(4)]
    short = ForwardContext(4096, documents=torch.arange(4096)[None] // 256).document_starts()
    assert ring_steps(positions, None, None, short) == 1
    long = ForwardContext(4096, documents=torch.arange(4096)[None] // 1536).document_starts()
    assert ring_steps(positions, None, None, long) == 2
    assert shipped_rows(positions, None, None, long) == [slice(0, 1024), slice(512, 1024), slice(1023, 1024),
                                                         slice(1023, 1024)]


def _tile_facts(block_map):
    tiles = block_map[0]
    return [[(t.q, t.k, t.causal, t.reverse, None if t.mask is None else t.mask.tolist()) for t in source]
            for source in tiles], block_map[1], block_map[2]


def test_a_layout_builds_its_block_map_once_and_another_layout_its_own():
    """Later forwards of the same layout (positions, documents, padding) reuse the first one's
    block map; other documents get their own, equal to one built afresh; a model keeps the maps of
    its last ``BLOCK_MAPS_KEPT`` layouts."""
    from fsdp_turbo.distributed.context_parallel.context import ForwardContext
    from fsdp_turbo.distributed.context_parallel.ring import BLOCK_MAPS_KEPT, _block_map, _build_block_map
    from fsdp_turbo.distributed.context_parallel.ring_math import chunk_positions

    positions = [chunk_positions(32, 4, r, False) for r in range(4)]
    state, cpu = CPState(group=None, size=4, rank=1, mode="ring"), torch.device("cpu")

    def context(documents=None):
        return ForwardContext(32, documents=documents, ring_positions=[p.clone() for p in positions])

    plain = _block_map(state, context(), cpu, 4, None)
    assert _block_map(state, context(), cpu, 4, None) is plain
    assert _block_map(state, context(), cpu, None, None) is not plain  # another mask kind
    documents = (torch.arange(32) // 8)[None]
    packed = _block_map(state, context(documents), cpu, 4, None)
    assert packed is not plain
    assert _tile_facts(packed) == _tile_facts(_build_block_map(state, context(documents), cpu, 4, None))
    assert _tile_facts(packed) != _tile_facts(plain)
    for length in range(1, BLOCK_MAPS_KEPT + 2):
        _block_map(state, context((torch.arange(32) // length)[None]), cpu, 4, None)
    assert len(state.block_maps) == BLOCK_MAPS_KEPT
    assert _block_map(state, context(), cpu, 4, None) is not plain  # the oldest layouts' maps are gone
