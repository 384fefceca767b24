"""DeepSpeed's partitioning rules, checked without files (dsckpt.zero.partitioning), then against DeepSpeed itself."""
import math

import pytest

from dsckpt.zero.partitioning import stage3_group, stage12_group


def _gather(layout, numels):
    """Rebuild every parameter from its spans: element (param, i) -> (rank, offset); each exactly once."""
    seen = {}
    for p, spans in enumerate(layout.params):
        for s in spans:
            assert 0 <= s.rank < layout.world_size and 0 <= s.rank_start
            assert s.rank_start + s.count <= layout.partition_numel
            for i in range(s.count):
                seen[(p, s.param_start + i)] = (s.rank, s.rank_start + i)
    assert sorted(seen) == [(p, i) for p, n in enumerate(numels) for i in range(n)]
    assert len(set(seen.values())) == len(seen)  # no two elements share a slot
    return seen


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("numels", [[3737, 1961, 53, 37, 7], [1], [0, 5], [16, 16, 16]])
def test_stage12_any_world_size(numels, world_size):
    layout = stage12_group(numels, world_size)
    assert layout.partition_numel * world_size % (2 * world_size) == 0
    assert layout.partition_numel * world_size >= sum(numels)
    assert layout.partition_numel * world_size - sum(numels) < 2 * world_size  # only the tail padding
    seen = _gather(layout, numels)
    flat = [seen[(p, i)] for p, n in enumerate(numels) for i in range(n)]
    assert [r * layout.partition_numel + o for r, o in flat] == list(range(sum(numels)))  # back to back


def test_stage12_alignment_padding_moves_later_parameters():
    numels, paddings = [5, 6, 3], [3, 2, 0]  # fp32 with parameter alignment 4: 5 -> 8, 6 -> 8
    layout = stage12_group(numels, 3, paddings)
    assert layout.used_numel == 5 + 3 + 6 + 2 + 3
    assert layout.partition_numel == math.ceil(19 / 6) * 6 // 3  # 24 / 3 = 8
    starts = [s[0].rank * layout.partition_numel + s[0].rank_start for s in layout.params]
    assert starts == [0, 8, 16]
    assert [(s.rank, s.rank_start, s.count) for s in layout.params[1]] == [(1, 0, 6)]
    assert [(s.rank, s.rank_start, s.param_start, s.count) for s in layout.params[0]] == [(0, 0, 0, 5)]
    straddling = stage12_group([10], 3).params[0]  # 10 elements over partitions of 4: three ranks
    assert [(s.rank, s.rank_start, s.param_start, s.count) for s in straddling] == [(0, 0, 0, 4), (1, 0, 4, 4), (2, 0, 8, 2)]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7])
def test_stage3_any_world_size(world_size):
    numels = [3737, 1961, 53, 37, 7, 1, 0]
    layout = stage3_group(numels, world_size)
    assert layout.partition_numel == sum(math.ceil(n / world_size) for n in numels)
    _gather(layout, numels)
    for n, spans in zip(numels, layout.params):  # every rank's part of a parameter is at the same offset
        assert len({s.rank_start for s in spans}) <= 1
        assert sum(s.count for s in spans) == n


def test_stage3_last_ranks_hold_padding_or_nothing():
    spans = stage3_group([7], 4).params[0]  # parts of 2: ranks 0-2 hold 2, 2, 2; rank 3 holds 1
    assert [(s.rank, s.param_start, s.count) for s in spans] == [(0, 0, 2), (1, 2, 2), (2, 4, 2), (3, 6, 1)]
    spans = stage3_group([2], 3).params[0]  # parts of 1: rank 2 holds only padding
    assert [(s.rank, s.count) for s in spans] == [(0, 1), (1, 1)]


@pytest.mark.parametrize("bad", [([3], 0), ([-1], 2), ([2], 1.5)])
def test_bad_arguments(bad):
    with pytest.raises(ValueError):
        stage12_group(*bad)
    with pytest.raises(ValueError):
        stage3_group(*bad)


def test_stage12_buffer_is_sized_for_the_last_parameters_rounding_too():
    """DeepSpeed sizes the buffer with max_param_padding, which rounds the last parameter up as well."""
    # bf16 with parameter alignment: 8 elements; 5 -> pad 3, last 6 -> no pad but sized as 8
    layout = stage12_group([5, 6], 2, [3, 0], alignment=8)
    assert layout.used_numel == 14 and layout.partition_numel == 8  # 5 + 3 + 6 + 2 = 16 -> 2 ranks x 8
    assert stage12_group([5, 6], 2, [3, 0]).partition_numel == 8  # ceil(14 / 4) * 4 / 2 = 8 as well
    assert stage12_group([5, 7], 3, [3, 0], alignment=8).partition_numel == 6  # 16 -> ceil(16/6)*6 = 18 / 3


def test_fixture_partitions_match_the_rules():
    """Against what DeepSpeed wrote: each rank's recorded partition size is what the rules give."""
    import math

    from conftest import FIXTURE_NAMES, FIXTURES
    from dsckpt.zero.reader import open_checkpoint

    checked = 0
    for name in FIXTURE_NAMES:
        ckpt = open_checkpoint(FIXTURES / name)
        for rank in ckpt.optimizer_states:
            if ckpt.zero_stage == 3:
                want = stage3_group([math.prod(s) for s in ckpt.trainable.values()], ckpt.world_size).partition_numel
                assert sum(g.fp32.numel for g in rank.groups) == want, name
            else:
                for g, shapes in enumerate(ckpt.param_groups):
                    layout = stage12_group([math.prod(s) for s in shapes.values()], ckpt.world_size,
                                           list(rank.alignment_paddings[g]))
                    assert rank.groups[g].fp32.numel == layout.partition_numel, name
            for group in rank.groups:
                assert all(m.numel == group.fp32.numel for m in group.moments.values())
            checked += 1
    assert checked >= 15


def test_one_range_merge_joins_overlapping_and_near_spans_whatever_their_order():
    """``plan.segments.joined_spans`` is the merge a fetch, a transfer, the read-ahead advice and a fill's arrivals
    all use (#53: there were four)."""
    from dsckpt.plan.segments import joined_spans

    spans = [(50, 60), (0, 10), (10, 20), (5, 8), (30, 40), (61, 70)]
    assert joined_spans(spans) == [(0, 20), (30, 40), (50, 60), (61, 70)]
    assert joined_spans(spans, gap=1) == [(0, 20), (30, 40), (50, 70)]
    assert joined_spans(spans, gap=9) == [(0, 20), (30, 40), (50, 70)] and joined_spans(spans, gap=10) == [(0, 70)]
    assert joined_spans([]) == []
