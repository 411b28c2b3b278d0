"""The accelerate pattern (prepare, save_state / load_state, adaptive steps) with the real
accelerate, tiny BERT, CPU, one process."""

from __future__ import annotations

import warnings

import pytest
import torch

accelerate = pytest.importorskip("accelerate")
pytest.importorskip("transformers")

from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from tests.integrations.tiny import B, N, dataset, params, tiny_bert  # noqa: E402
from torch.utils.data import BatchSampler, DataLoader  # noqa: E402

from grabkit import OptimizerWrapperGNTS  # noqa: E402
from grabkit.integrations.accelerate import (  # noqa: E402
    SamplerCheckpoint,
    adaptive_step,
    shard_by_sampler,
)
from grabkit.noise import AccumulationNoiseScale  # noqa: E402
from grabkit.order import GraBSampler  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def fresh_accelerator_state():
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def run(root, registered, *, stop_after=None, resume=False, epochs=2, skip=0):
    """GraB loop under accelerate; save_state after ``stop_after`` updates and stop there;
    ``skip``: the resumed epoch through ``accelerator.skip_first_batches(loader, skip)``."""
    accelerator = Accelerator(cpu=True, project_dir=str(root))
    model, data = tiny_bert(), dataset()
    sampler = GraBSampler(data, model=model, seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(data, sampler=sampler, batch_size=B)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    accelerator.register_for_checkpointing(registered(sampler))
    trained, updates = 0, 0
    if resume:
        accelerator.load_state(str(root / "state"))
    start_epoch = sampler.epoch
    for epoch in range(start_epoch, epochs):
        loader.set_epoch(epoch)  # the prepared loader's count: it renumbers the sampler
        batches = accelerator.skip_first_batches(loader, skip) if skip else loader
        skip = 0
        for batch in batches:
            accelerator.backward(model(**batch).loss)
            sampler.step()
            optimizer.step()
            optimizer.zero_grad()
            trained, updates = trained + len(batch["labels"]), updates + 1
            if updates == stop_after:
                accelerator.save_state(str(root / "state"))
                return model, sampler, trained
    return model, sampler, trained


def test_save_state_load_state_resumes_bitwise(tmp_path):
    full_model, full_sampler, _ = run(tmp_path, SamplerCheckpoint)
    run(tmp_path, SamplerCheckpoint, stop_after=8)  # mid-epoch 1: 6 batches an epoch
    model, sampler, trained = run(tmp_path, SamplerCheckpoint, resume=True)
    assert trained == 2 * N - 8 * B  # nothing lost, nothing repeated
    assert torch.equal(sampler.order, full_sampler.order)
    for name, value in params(model).items():
        assert torch.equal(value, params(full_model)[name]), name


def test_skip_first_batches_after_a_sampler_checkpoint_is_refused(tmp_path):
    """accelerate's own recipe skips the batches trained before the checkpoint, but
    ``SamplerCheckpoint`` already resumes the epoch's untrained rest: the skipped batches would
    never be trained (2 of them, 8 examples) and GraB would credit the gradients of the batches
    after them to their examples. Refused at the resumed loader's first batch."""
    run(tmp_path, SamplerCheckpoint, stop_after=2)
    with pytest.raises(ValueError, match=r"skip_first_batches.*SamplerCheckpoint"):
        run(tmp_path, SamplerCheckpoint, resume=True, skip=2)


def test_naive_registered_sampler_loses_the_prefetched_batch(tmp_path):
    run(tmp_path, lambda sampler: sampler, stop_after=8)
    _, _, trained = run(tmp_path, lambda sampler: sampler, resume=True)
    assert trained == 2 * N - 8 * B - B  # the batch accelerate fetched ahead is never trained


def test_adaptive_step_passes_count_and_skips(tmp_path):
    accelerator = Accelerator(cpu=True)
    model = tiny_bert()
    wrapper = OptimizerWrapperGNTS(
        torch.optim.SGD(model.parameters(), lr=0.1), max_batch_draws=4, norm_threshold=0.1
    )
    loader = DataLoader(dataset(), batch_size=B)
    model, optimizer, loader = accelerator.prepare(model, wrapper, loader)
    with pytest.raises(TypeError):
        optimizer.step(count=B)  # what accelerate itself answers
    for batch in loader:
        accelerator.backward(model(**batch).loss)
        adaptive_step(optimizer, count=len(batch["labels"]))
    assert 0 < wrapper.num_steps < N // B
    assert float(wrapper.last_step_count) == B * wrapper.last_step_num_draws


def test_adaptive_step_refuses_accelerate_accumulation():
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = tiny_bert()
    wrapper = OptimizerWrapperGNTS(torch.optim.SGD(model.parameters(), lr=0.1))
    _, optimizer = accelerator.prepare(model, wrapper)
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        adaptive_step(optimizer, count=B)


def test_the_window_left_at_the_end_is_flushed_by_the_wrapper_inside():
    """AcceleratedOptimizer has no flush(); the wrapper inside it applies the window still
    accumulating when the loop ends, as the plain wrapper's flush() does."""
    from accelerate.optimizer import AcceleratedOptimizer

    Accelerator(cpu=True)
    torch.manual_seed(0)
    model, reference = torch.nn.Linear(8, 2), torch.nn.Linear(8, 2)
    reference.load_state_dict(model.state_dict())

    def every_two(m):
        sgd = torch.optim.SGD(m.parameters(), lr=0.1)
        return OptimizerWrapperGNTS(sgd, max_batch_draws=2, norm_threshold=1e-9)

    wrapper, reference_wrapper = every_two(model), every_two(reference)
    optimizer = AcceleratedOptimizer(wrapper, device_placement=False)
    x, y = torch.randn(12, 8), torch.randint(0, 2, (12,))
    for part in range(3):  # a window of 2 microbatches, then 1 left accumulating
        rows = slice(4 * part, 4 * part + 4)
        torch.nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()
        adaptive_step(optimizer, count=4)
        torch.nn.functional.cross_entropy(reference(x[rows]), y[rows]).backward()
        reference_wrapper.step(count=4)
    assert wrapper.num_draws == 1
    assert optimizer.optimizer.flush() and reference_wrapper.flush()
    assert wrapper.num_steps == 2 and wrapper.num_draws == 0
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q)


def test_adaptive_step_through_accelerates_grad_scaler():
    """The GradScaler path: accelerate's AcceleratedOptimizer with a (CPU) GradScaler."""
    from accelerate.optimizer import AcceleratedOptimizer

    Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    reference = torch.nn.Linear(8, 2)
    reference.load_state_dict(model.state_dict())

    def gnts_every_two(m):
        sgd = torch.optim.SGD(m.parameters(), lr=0.1)
        return OptimizerWrapperGNTS(sgd, max_batch_draws=2, norm_threshold=1e-9)

    wrapper, reference_wrapper = gnts_every_two(model), gnts_every_two(reference)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    optimizer = AcceleratedOptimizer(wrapper, device_placement=False, scaler=scaler)
    x, y = torch.randn(16, 8), torch.randint(0, 2, (16,))
    for part in range(4):
        rows = slice(4 * part, 4 * part + 4)
        scaler.scale(torch.nn.functional.cross_entropy(model(x[rows]), y[rows])).backward()
        adaptive_step(optimizer, count=4)
        torch.nn.functional.cross_entropy(reference(x[rows]), y[rows]).backward()
        reference_wrapper.step(count=4)
    assert wrapper.num_steps == reference_wrapper.num_steps == 2
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q)
    model.weight.grad = torch.full_like(model.weight, float("inf"))  # an overflowed microbatch
    model.bias.grad = torch.zeros_like(model.bias)
    assert adaptive_step(optimizer, count=4) is False
    assert wrapper.num_skipped == 1 and wrapper.num_draws == 0


def _sharded(rank: int, **shard_options) -> DataLoader:
    """What ``prepare()`` builds on process ``rank`` of 2 for a GraB loader of 21 examples in
    batches of 4: accelerate's ``BatchSamplerShard`` around the loader's batch sampler. The
    sampler (mean balancing, dense gradients) splits the epoch itself, 11 examples a process
    (one of them padding)."""
    from accelerate.data_loader import BatchSamplerShard

    sampler = GraBSampler(range(21), balance_type="mean", num_replicas=2, rank=rank, batch_size=4)
    shard = BatchSamplerShard(
        BatchSampler(sampler, 4, drop_last=False), num_processes=2, process_index=rank,
        **shard_options,
    )  # fmt: skip
    return DataLoader(range(21), batch_sampler=shard)


@pytest.mark.parametrize("rank", [0, 1])
def test_shard_by_sampler_passes_a_partial_last_batch_through(rank):
    """Batches of 4, 4 and 3 on each process: accelerate's even_batches (its default) completed
    the last one with the epoch's first example, which this process's sampler never yielded
    there (its step then refused 4 gradients for the 3 examples left); shard_by_sampler passes
    the sampler's own batches through."""
    loader = _sharded(rank)
    twin = GraBSampler(range(21), balance_type="mean", num_replicas=2, rank=rank, batch_size=4)
    expected = list(BatchSampler(twin, 4, drop_last=False))
    assert [len(batch) for batch in expected] == [4, 4, 3]
    assert [batch.tolist() for batch in shard_by_sampler(loader)] == expected
    assert len(loader) == 3


def test_shard_by_sampler_refuses_split_batches():
    """split_batches=True reads batch_size=4 as both processes' batch (2 each); kept whole, each
    process would train 4 of its share, twice the global batch asked for."""
    loader = _sharded(0, split_batches=True)
    with pytest.raises(ValueError, match=r"split_batches=True.*batch_size=2"):
        shard_by_sampler(loader)


def test_a_grab_loader_dispatched_to_several_processes_is_refused_at_its_first_batch():
    """dispatch_batches=True without shard_by_sampler (which refuses it on every process):
    process 0 alone draws from the loader and slices its batches for all, and its sampler
    waited in its first collective for processes that never reach it. Refused at the first
    batch, before any collective. One process runs this test: the dispatcher's process count
    is set to 2 by hand."""
    from types import SimpleNamespace

    from accelerate.data_loader import DataLoaderDispatcher

    Accelerator(cpu=True)
    sampler = GraBSampler(range(8), balance_type="mean", num_replicas=2, rank=0, batch_size=2)
    loader = DataLoaderDispatcher(range(8), sampler=sampler, batch_size=2)
    loader.state = SimpleNamespace(num_processes=2, process_index=0, device=torch.device("cpu"))
    with pytest.raises(ValueError, match=r"dispatch_batches=True on 2 processes.*shard_by_sampler"):
        next(iter(loader))


def test_accelerates_stateful_loader_is_refused_at_its_first_batch():
    """DataLoaderConfiguration(use_stateful_dataloader=True): after load_state torchdata
    fast-forwards the loader's plain BatchSampler by the batches it counted. Resumed inside an
    epoch on top of SamplerCheckpoint, that skipped untrained batches (refused at a later step,
    naming nothing of the cause); without SamplerCheckpoint no GraB state was saved, and a
    resume at an epoch's end ordered the next epochs otherwise than the uninterrupted run
    (other parameters), silently. Refused when the loader first draws from the sampler."""
    pytest.importorskip("torchdata")
    from accelerate import DataLoaderConfiguration

    config = DataLoaderConfiguration(use_stateful_dataloader=True)
    accelerator = Accelerator(cpu=True, dataloader_config=config)
    model, data = _mlp_and_rows()
    sampler = GraBSampler(data, model=model, batch_size=2)
    loader = accelerator.prepare(DataLoader(data, sampler=sampler, batch_size=2))
    with pytest.raises(ValueError, match=r"use_stateful_dataloader=True.*SamplerCheckpoint"):
        next(iter(loader))


def test_accelerate_accumulate_balances_each_microbatch_as_the_plain_loop():
    """accumulate() with 2 microbatches a window (the epoch's 7th alone, which accelerate still
    divides by 2), the hook-mode sampler stepped at each window's end: the orders and parameters
    of the same loop without accelerate (each loss divided by 2, backwards then one step)."""
    got = _accumulating_run(None)
    model, data = _mlp_and_rows()
    sampler = GraBSampler(data, model=model, batch_size=2, record_orders=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        batches = list(DataLoader(data, sampler=sampler, batch_size=2))
        for i, (x, y, _) in enumerate(batches):
            (torch.nn.functional.cross_entropy(model(x), y) / 2).backward()
            if i % 2 == 1 or i == len(batches) - 1:
                sampler.step()
                optimizer.step()
                optimizer.zero_grad()
    assert got["orders"] == sampler.orders_history
    assert len({tuple(order) for order in got["orders"]}) == 3
    for name, value in params(model).items():
        assert torch.equal(got["params"][name], value), name


def test_save_state_before_the_sampler_stepped_its_backwards_is_refused(tmp_path):
    """The same loop: a save_state after a window's first microbatch found the sampler with a
    backward it had not stepped. Its statistics are in no state and the resumed loader yielded
    its examples again (trained twice: 38 examples after the checkpoint where the
    uninterrupted run trains 36), without a word. Refused, naming sync_gradients."""
    with pytest.raises(ValueError, match=r"not stepped.*sync_gradients"):
        _accumulating_run(tmp_path, save_at=3)


def test_save_state_inside_an_accumulation_window_is_refused(tmp_path):
    """The sampler stepped after every microbatch, the state saved after the first microbatch
    of a window (a loop stopped there, or a save counted in microbatches): accelerate's
    save_state holds no accumulated gradient, so the resumed run stepped on the window's second
    microbatch alone; its data and order resumed exactly and its parameters differed, without a
    word. Refused, naming sync_gradients."""
    with pytest.raises(ValueError, match=r"inside an accumulation window.*sync_gradients"):
        _accumulating_run(tmp_path, save_at=3, step_every=True)


def test_accelerate_accumulate_window_resumes_bitwise(tmp_path):
    """The same loop saved after a window's last microbatch (its optimizer step)."""
    full = _accumulating_run(tmp_path, save_at=4)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    resumed = _accumulating_run(tmp_path, resume=4)
    assert resumed["seen"] == full["seen"][4:]
    assert resumed["orders"] == full["orders"]
    for name, value in resumed["params"].items():
        assert torch.equal(value, full["params"][name]), name


def _mlp_and_rows() -> tuple[torch.nn.Module, torch.utils.data.TensorDataset]:
    """A small MLP and 14 rows (inputs, labels, row index)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2))
    rows = torch.Generator().manual_seed(1)
    x, y = torch.randn(14, 5, generator=rows), torch.randint(0, 2, (14,), generator=rows)
    return model, torch.utils.data.TensorDataset(x, y, torch.arange(14))


def _accumulating_run(root, *, save_at=None, resume=None, step_every=False) -> dict:
    """``_mlp_and_rows`` in batches of 2 under accumulate() with 2 microbatches a window, 3
    epochs; the hook-mode sampler stepped when accelerate synchronises (a window's end), or
    after every microbatch (``step_every``)."""
    folder = None if root is None else str(root)
    accelerator = Accelerator(cpu=True, project_dir=folder, gradient_accumulation_steps=2)
    model, data = _mlp_and_rows()
    sampler = GraBSampler(data, model=model, batch_size=2, record_orders=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(data, sampler=sampler, batch_size=2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    accelerator.register_for_checkpointing(SamplerCheckpoint(sampler))
    microbatches, first, seen = 0, 0, []
    if resume is not None:
        accelerator.load_state(str(root / "state"))
        microbatches, first = resume, resume // len(loader)
    for epoch in range(first, 3):
        loader.set_epoch(epoch)
        for x, y, index in loader:
            with accelerator.accumulate(model):
                accelerator.backward(torch.nn.functional.cross_entropy(model(x), y))
                if accelerator.sync_gradients or step_every:
                    sampler.step()  # the window's microbatches, each to its own examples
                optimizer.step()
                optimizer.zero_grad()
            microbatches += 1
            seen.append(index.tolist())
            if microbatches == save_at:
                accelerator.save_state(str(root / "state"))
    return {"seen": seen, "orders": sampler.orders_history, "params": params(model)}


def _adaptive_run(root, epochs: int, *, resume=False, save=None) -> dict:
    """``_mlp_and_rows`` in batches of 3 (5 an epoch), GraB, windows of four microbatches
    (``adaptive_step``) across epochs, and the noise scale of the windows applied; after the
    loop the wrapper's flush, with ``save_state`` before it (``save="before"``) or after it."""
    accelerator = Accelerator(cpu=True, project_dir=str(root))
    model, data = _mlp_and_rows()
    sampler = GraBSampler(data, model=model, batch_size=3, record_orders=True)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapper = OptimizerWrapperGNTS(sgd, max_batch_draws=4, norm_threshold=0.0)
    noise = AccumulationNoiseScale(model, optimizer=wrapper, update_rate=0.5)
    loader = DataLoader(data, sampler=sampler, batch_size=3)
    model, optimizer, loader = accelerator.prepare(model, wrapper, loader)
    accelerator.register_for_checkpointing(SamplerCheckpoint(sampler), noise)
    if resume:
        accelerator.load_state(str(root / "state"))
    for epoch in range(sampler.epoch + resume, epochs):
        loader.set_epoch(epoch)
        for x, y, _ in loader:
            accelerator.backward(torch.nn.functional.cross_entropy(model(x), y))
            sampler.step()
            adaptive_step(optimizer, count=len(y))
    if save == "before":
        accelerator.save_state(str(root / "state"))
    optimizer.optimizer.flush()
    if save == "after":
        accelerator.save_state(str(root / "state"))
    result = noise.estimate
    return {
        "orders": sampler.orders_history, "params": params(model), "updates": wrapper.num_steps,
        "noise": (result.grad_norm_sq, result.trace_sigma, result.observations),
    }  # fmt: skip


def test_a_loop_continued_after_its_end_equals_the_longer_run_or_warns(tmp_path):
    """Two epochs end with a window of two microbatches open, which the flush after the loop
    applies. A state saved before that flush holds the open window: continued to three epochs,
    the run is the three-epoch run (orders, parameters, updates, noise scale). A state saved
    after it holds the early update: continued, it had one update more (5 against 4) and other
    parameters and noise scale, without a word; the wrapper warns at its first step."""
    full = _adaptive_run(tmp_path / "full", 3)
    for save in ("before", "after"):
        _reset()
        _adaptive_run(tmp_path / save, 2, save=save)
        _reset()
        if save == "before":
            with warnings.catch_warnings():
                warnings.filterwarnings("error", message="OptimizerWrapperGNTS")
                continued = _adaptive_run(tmp_path / save, 3, resume=True)
            assert continued["orders"][-1] == full["orders"][-1]
            assert continued["noise"] == full["noise"] and continued["updates"] == 4
            for name, value in continued["params"].items():
                assert torch.equal(value, full["params"][name]), name
        else:
            with pytest.warns(UserWarning, match=r"OptimizerWrapperGNTS: .*after flush\(\)"):
                continued = _adaptive_run(tmp_path / save, 3, resume=True)
            assert continued["updates"] == full["updates"] + 1


def _reset() -> None:
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
