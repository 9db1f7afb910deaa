"""placement/dims.py: the one parallel layout every part reads its ranks from."""

import itertools

import pytest

from orttrainer import ORTTrainerOptions
from orttrainer.placement.dims import Coords, LayoutError, ParallelDims

LAYOUTS = [(1, 1, 1), (4, 1, 1), (2, 2, 1), (1, 4, 1), (3, 2, 1), (2, 1, 2), (1, 1, 4), (2, 2, 2)]


@pytest.mark.parametrize("data, tensor, pipeline", LAYOUTS)
def test_every_rank_has_one_place_and_the_groups_partition_the_world(data, tensor, pipeline):
    dims = ParallelDims(data * tensor * pipeline, data, tensor, pipeline)
    world = list(range(dims.world_size))
    places = [dims.coords(rank) for rank in world]
    assert len(set(places)) == dims.world_size
    assert [dims.rank_of(*place) for place in places] == world
    for groups, size, axis in ((dims.tensor_groups(), tensor, "tensor"), (dims.data_groups(), data, "data"),
                               (dims.pipeline_groups(), pipeline, "pipeline")):
        assert sorted(itertools.chain(*groups)) == world and {len(g) for g in groups} == {size}
        for group in groups:  # a group's ranks differ in its own axis only, in that axis's order
            coords = [dims.coords(rank) for rank in group]
            assert [getattr(c, axis) for c in coords] == list(range(size))
            others = [c._replace(**{axis: 0}) for c in coords]
            assert len(set(others)) == 1
    for rank in world:
        assert rank in dims.tensor_group(rank) and rank in dims.data_group(rank) and rank in dims.pipeline_group(rank)


def test_the_original_rank_order():
    # Megatron: consecutive tensor groups, strided data groups (the original's aggregation layout).
    dims = ParallelDims(4, 2, 2)
    assert dims.tensor_groups() == [[0, 1], [2, 3]] and dims.data_groups() == [[0, 2], [1, 3]]
    assert dims.coords(3) == Coords(data=1, tensor=1, pipeline=0)
    # Pipeline: stage-major, rank = stage * D + d.
    dims = ParallelDims(6, 3, 1, 2)
    assert dims.pipeline_groups() == [[0, 3], [1, 4], [2, 5]] and dims.data_groups() == [[0, 1, 2], [3, 4, 5]]
    assert dims.coords(4) == Coords(data=1, tensor=0, pipeline=1)


def test_a_layout_that_does_not_multiply_to_the_world_names_every_factor():
    with pytest.raises(LayoutError) as caught:
        ParallelDims(8, 2, 2, 1)
    message = str(caught.value)
    for part in ("data_parallel_size (2)", "horizontal_parallel_size (2)", "pipeline_parallel_size (1)", "= 4",
                 "world_size (8)"):
        assert part in message
    with pytest.raises(LayoutError, match=r"horizontal_parallel_size \(3\) x .*pipeline_parallel_size \(1\) = 3 "
                                          r"must divide distributed.world_size \(4\)"):
        ParallelDims.resolve(4, 1, 3, 1)
    with pytest.raises(LayoutError, match="integers >= 1: got distributed.data_parallel_size=0"):
        ParallelDims(4, 0, 2)
    with pytest.raises(ValueError, match="rank 4 is outside 0..3"):
        ParallelDims(4, 4).coords(4)


def test_built_from_the_options_with_the_data_size_inferred_and_the_flags():
    options = ORTTrainerOptions({"distributed": {"world_size": 4, "horizontal_parallel_size": 2,
                                                 "deepspeed_zero_optimization": {"stage": 1}}})
    dims = ParallelDims.of(options.distributed)
    assert (dims.world_size, dims.data, dims.tensor, dims.pipeline) == (4, 2, 2, 1)
    assert dims.zero and dims.tensor_parallel and not dims.pipeline_parallel and not dims.adasum
    assert ParallelDims.of(options._validated_opts["distributed"]) == dims  # the dict form agrees
    assert str(dims) == "4 ranks = 2 data-parallel x 2 tensor-parallel x 1 pipeline stages"


@pytest.mark.parametrize("distributed, named", [
    ({"world_size": 3, "enable_adasum": True}, "Adasum combines the ranks in pairs"),
    ({"world_size": 2, "enable_adasum": True, "deepspeed_zero_optimization": {"stage": 1}},
     "use one or the other"),
    ({"world_size": 2, "pipeline_parallel": {"pipeline_parallel_size": 2}, "enable_adasum": True},
     "distributed.enable_adasum with pipeline_parallel_size=2 is not built"),
])
def test_what_cannot_run_is_named(distributed, named):
    dims = ParallelDims.of(ORTTrainerOptions({"distributed": distributed}).distributed)
    assert any(named in problem for problem in dims.unsupported())
    assert ParallelDims(4, 2, 2).unsupported() == []
