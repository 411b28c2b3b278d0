"""GrabkitTrainer and the accelerate recipe on two gloo processes (spawned, loopback, CPU).

One spawn serves every test here (each rank imports transformers once):

* ``GrabkitTrainer(grab={"statistics": "sketch"}, noise_scale={})`` with gradient accumulation, a
  float64 tiny BERT (so that DDP's averaged update is the one-process update): both ranks hold the
  order of a one-process sketch-mode sampler stepped on the same global microbatches, every
  example is trained once per epoch, the noise scale equals ``MicrobatchNoiseScale`` fed each
  rank's local window gradient by hand, and a resume from rank 0's checkpoint (mid-epoch, at an
  epoch's last step, or the last checkpoint of a one-epoch run continued with a second epoch)
  ends with the uninterrupted run's orders, parameters and estimate; without
  accumulation (every microbatch synchronised, the first one included) the noise scale is that
  estimate too; accelerate's ``sync_each_batch``, which leaves no rank its own window gradient,
  is refused at construction;
* the README's accelerate multi-process block, run as written on both ranks; without its
  ``shard_by_sampler`` line the first batch is refused, naming it;
* that recipe on 21 examples in batches of 4 (each rank's share, 11 with one padding example,
  ends in a partial batch, which accelerate's default ``even_batches`` would complete with other
  examples): every rank trains the sampler's split, and ``load_state`` of rank 0's state at an
  epoch's last step, inside an epoch, or saved after a two-epoch run's epoch loop (outside the
  loader) and continued with a third epoch resumes bitwise; ``dispatch_batches=True`` is refused
  on every rank;
* ``AccumulationNoiseScale`` following an adaptive wrapper (``adaptive_step``), registered for
  ``save_state`` with a window open: rank 0's state holds its own microbatches' norms, which
  rank 1 refuses to take as its own.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from tests.integrations.tiny import N, batch, dataset, tiny_bert
from tests.support.distributed import run_distributed

from grabkit.noise import MicrobatchNoiseScale
from grabkit.order import GraBSampler
from grabkit.order.distributed import padded_order

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

W, B, K, SKETCH, EPOCHS = 2, 3, 2, 64, 2  # 12 examples a rank and epoch: 2 windows of 2 x 3
UNEVEN, UB = 21, 4  # 11 examples a rank and epoch (one of them padding): batches of 4, 4 and 3
README = Path(__file__).resolve().parents[2] / "README.md"


def _readme_block() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    return next(code for code in blocks if "shard_by_sampler(loader)" in code)


class _Recorder:
    """The data collator: stacks the rows and records which examples this rank trained."""

    def __init__(self) -> None:
        self.index = {tuple(row["input_ids"].tolist()): i for i, row in enumerate(dataset())}
        self.seen: list[int] = []

    def __call__(self, rows):
        from transformers import default_data_collator

        self.seen += [self.index[tuple(row["input_ids"].tolist())] for row in rows]
        return default_data_collator(rows)


def _trainer_run(
    out: str, resume: str | None = None, accumulation: int = K, epochs: int = EPOCHS
) -> dict:
    from transformers import TrainingArguments

    from grabkit.integrations.huggingface import GrabkitTrainer

    args = TrainingArguments(
        out, per_device_train_batch_size=B, gradient_accumulation_steps=accumulation,
        num_train_epochs=epochs,
        learning_rate=0.1, optim="sgd", lr_scheduler_type="constant", max_grad_norm=0.0,
        report_to=[], use_cpu=True, save_strategy="steps", save_steps=1, logging_steps=1,
        disable_tqdm=True, seed=0, log_level="error", ddp_backend="gloo",
    )  # fmt: skip
    recorder = _Recorder()
    trainer = GrabkitTrainer(
        tiny_bert().double(), args, train_dataset=dataset(), data_collator=recorder,
        grab={"statistics": "sketch", "sketch_dim": SKETCH, "record_orders": True},
        noise_scale={"update_rate": 0.5},
    )  # fmt: skip
    trainer.model_accepts_loss_kwargs = False  # each microbatch's mean over K: the plain mean
    trainer.train(resume_from_checkpoint=resume)
    result = trainer.noise_scale_result
    return {
        "orders": trainer.grab_sampler.orders_history,
        "seen": recorder.seen,
        "params": {k: v.detach().tolist() for k, v in trainer.model.named_parameters()},
        "noise": [result.grad_norm_sq, result.trace_sigma, result.observations],
        "replicas": [trainer.grab_sampler.num_replicas, trainer.grab_sampler.rank],
    }


def _sync_each_batch_refusal(out: str) -> str:
    """The error of a noise-measuring GrabkitTrainer whose accelerate config all-reduces every
    microbatch (the estimator raised at the first window, naming neither setting)."""
    from transformers import TrainingArguments

    from grabkit.integrations.huggingface import GrabkitTrainer

    accumulate = {"gradient_accumulation_kwargs": {"sync_each_batch": True}}
    args = TrainingArguments(
        out, per_device_train_batch_size=B, gradient_accumulation_steps=K, report_to=[],
        use_cpu=True, ddp_backend="gloo", accelerator_config=accumulate,
    )  # fmt: skip
    try:
        GrabkitTrainer(tiny_bert(), args, train_dataset=dataset(), noise_scale={})
    except ValueError as error:
        return str(error)
    return ""


def _readme_run(folder: str, keep_split: bool) -> dict:
    code = _readme_block()
    if not keep_split:
        code = code.replace("loader = shard_by_sampler(loader)", "")
    os.makedirs(folder, exist_ok=True)
    os.chdir(folder)
    namespace: dict = {"__name__": "__readme__"}
    try:
        exec(compile(code, str(README), "exec"), namespace)
    except ValueError as error:
        return {"error": str(error)}
    sampler = namespace["sampler"]
    return {
        "order": sampler.order.tolist(), "epoch": sampler.epoch, "replicas": sampler.num_replicas,
        "stepped": sampler.state_dict()["live"]["stepped"], "len": len(namespace["loader"]),
    }  # fmt: skip


def _uneven_run(root: str, *, epochs=3, save_at=(), resume=None, **loader_config) -> dict:
    """The multi-process recipe on ``UNEVEN`` examples (a small MLP, ``prob_balance`` so that the
    epoch numbers count), 3 epochs: ``save_state`` to ``step_<n>`` after the updates in
    ``save_at`` (``"end"``: after the epoch loop), or ``load_state`` of ``step_<resume>`` and the
    epoch loop from ``resume // len(loader)``. ``loader_config``: accelerate's
    ``DataLoaderConfiguration``."""
    from accelerate import Accelerator, DataLoaderConfiguration
    from torch.utils.data import DataLoader, TensorDataset

    from grabkit.integrations.accelerate import SamplerCheckpoint, shard_by_sampler

    config = DataLoaderConfiguration(**loader_config)
    accelerator = Accelerator(cpu=True, project_dir=root, dataloader_config=config)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2))
    rows = torch.Generator().manual_seed(1)
    x, y = torch.randn(UNEVEN, 5, generator=rows), torch.randint(0, 2, (UNEVEN,), generator=rows)
    data = TensorDataset(x, y, torch.arange(UNEVEN))
    sampler = GraBSampler(
        data, model=model, statistics="sketch", sketch_dim=16, batch_size=UB, prob_balance=True,
        record_orders=True,
    )  # fmt: skip
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(data, sampler=sampler, batch_size=UB)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    try:
        loader = shard_by_sampler(loader)
    except ValueError as error:
        return {"error": str(error)}
    accelerator.register_for_checkpointing(SamplerCheckpoint(sampler))
    updates, first, seen = 0, 0, []
    if resume is not None:
        accelerator.load_state(os.path.join(root, f"step_{resume}"))
        updates, first = resume, resume // len(loader)
    for epoch in range(first, epochs):
        loader.set_epoch(epoch)
        for inputs, labels, index in loader:
            accelerator.backward(torch.nn.functional.cross_entropy(model(inputs), labels))
            sampler.step()
            optimizer.step()
            optimizer.zero_grad()
            seen.append(index.tolist())
            updates += 1
            if updates in save_at:
                accelerator.save_state(os.path.join(root, f"step_{updates}"))
    if "end" in save_at:
        accelerator.save_state(os.path.join(root, f"step_{updates}"))
    return {
        "seen": seen, "orders": sampler.orders_history, "seed": sampler.seed,
        "params": [p.detach().tolist() for p in model.parameters()],
    }  # fmt: skip


def _noise_state_of_rank_0(root: str) -> str:
    """An adaptive window (4 microbatches) open after 6 microbatches of each rank when
    ``save_state`` saves rank 0's estimator; the error of this rank's ``load_state`` (or "")."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from torch.utils.data import DataLoader, TensorDataset

    from grabkit import OptimizerWrapperGNTS
    from grabkit.integrations.accelerate import adaptive_step
    from grabkit.noise import AccumulationNoiseScale

    rows = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(UNEVEN, 5, generator=rows), torch.randint(0, 2, (UNEVEN,)))
    for load in (False, True):
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        accelerator = Accelerator(cpu=True, project_dir=root)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2))
        sgd = torch.optim.SGD(model.parameters(), lr=0.1)
        wrapper = OptimizerWrapperGNTS(sgd, max_batch_draws=4, norm_threshold=0.0)
        noise = AccumulationNoiseScale(model, optimizer=wrapper, update_rate=0.5)
        loader = DataLoader(data, batch_size=UB)
        model, optimizer, loader = accelerator.prepare(model, wrapper, loader)
        accelerator.register_for_checkpointing(noise)
        if load:
            try:
                accelerator.load_state(os.path.join(root, "state"))
            except ValueError as error:
                return str(error)
            return ""
        for _ in range(2):
            for x, y in loader:
                accelerator.backward(torch.nn.functional.cross_entropy(model(x), y))
                adaptive_step(optimizer, count=len(y))
        accelerator.save_state(os.path.join(root, "state"))
    return ""


def _uneven_runs(root: str) -> dict:
    """The uninterrupted run (saving after epoch 0's last update, 3, and inside epoch 1, 5), its
    two resumes, a two-epoch run saved after its loop (6) continued, and the refused
    ``dispatch_batches=True``."""
    runs = {"full": _uneven_run(root, save_at=(3, 5))}
    _uneven_run(root, epochs=2, save_at=("end",))
    for step in (3, 5, 6):
        runs[step] = _uneven_run(root, resume=step)
    runs["dispatch"] = _uneven_run(root, dispatch_batches=True)
    runs["noise"] = _noise_state_of_rank_0(os.path.join(root, "noise"))
    return runs


def _body(rank: int, world_size: int, root: str) -> dict:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    os.environ["LOCAL_WORLD_SIZE"] = str(world_size)
    full = _trainer_run(os.path.join(root, "full"))
    steps_per_epoch = N // (W * B * K)
    resumed = {}  # from rank 0's checkpoint: epoch 0's last step, and mid-epoch 1
    for step in (steps_per_epoch, steps_per_epoch + 1):
        checkpoint = os.path.join(root, "full", f"checkpoint-{step}")
        resumed[step] = _trainer_run(os.path.join(root, f"resumed{step}"), checkpoint)
    first = os.path.join(root, "first")  # one epoch, continued from its last checkpoint
    _trainer_run(first, epochs=1)
    checkpoint = os.path.join(first, f"checkpoint-{steps_per_epoch}")
    resumed["end"] = _trainer_run(first, checkpoint)
    single = _trainer_run(os.path.join(root, "single"), accumulation=1)
    single["sync_each_batch"] = _sync_each_batch_refusal(os.path.join(root, "sync"))
    readme = _readme_run(os.path.join(root, f"readme{rank}"), keep_split=True)
    refused = _readme_run(os.path.join(root, f"refused{rank}"), keep_split=False)
    uneven = _uneven_runs(os.path.join(root, "uneven"))
    return {
        "full": full, "resumed": resumed, "single": single, "readme": readme, "refused": refused,
        "uneven": uneven,
    }  # fmt: skip


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return run_distributed(_body, W, payload=str(tmp_path_factory.mktemp("mp")), timeout=900)


@functools.cache
def _reference(k: int = K) -> tuple[list[list[int]], dict[str, torch.Tensor], object]:
    """One process: the sketch-mode sampler stepped on the global microbatches (W * B rows, in
    the order the ranks visit them together), SGD on the mean of windows of ``k``; and the DDP
    noise scale by hand from each rank's local window gradient (mean over its k * B rows)
    against their average."""
    model, data = tiny_bert().double(), dataset()
    probe = tiny_bert().double()  # the noise reference's own backwards, away from the hooks
    sampler = GraBSampler(
        data, model=model, statistics="sketch", sketch_dim=SKETCH, seed=0, record_orders=True,
        num_replicas=1, rank=0,
    )  # fmt: skip
    names = [name for name, _ in model.named_parameters()]
    noise = MicrobatchNoiseScale(update_rate=0.5, block_names=tuple(names))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        order = list(sampler)
        for start in range(0, N, W * B * k):
            probe.load_state_dict(model.state_dict())
            local = []
            for r in range(W):
                rows = order[start + r : start + W * B * k : W]
                grads = torch.autograd.grad(
                    probe(**batch(data, rows)).loss, list(probe.parameters())
                )
                local.append(grads)
            squares = torch.tensor([[g.pow(2).sum() for g in grads] for grads in local])
            average = [(a + b) / 2 for a, b in zip(*local, strict=True)]
            noise.observe_microbatches(squares, [B * k] * W)
            noise.observe_step(torch.stack([g.pow(2).sum() for g in average]))
            for m in range(k):
                rows = order[start + m * W * B : start + (m + 1) * W * B]
                (model(**batch(data, rows)).loss / k).backward()
                sampler.step()
            opt.step()
            opt.zero_grad()
    params = {k: v.detach() for k, v in model.named_parameters()}
    return sampler.orders_history, params, noise.estimate


def test_trainer_ranks_share_the_one_process_order_and_train_each_example_once(ranks):
    orders, params, _ = _reference()
    assert len({tuple(order) for order in orders}) == EPOCHS  # the gradients moved the order
    for rank, got in enumerate(ranks):
        assert got["full"]["replicas"] == [W, rank]
        assert got["full"]["orders"] == orders
        for name, value in got["full"]["params"].items():
            torch.testing.assert_close(torch.tensor(value, dtype=torch.float64), params[name])
    seen = sorted(i for got in ranks for i in got["full"]["seen"])
    assert seen == sorted(list(range(N)) * EPOCHS)  # each example once per epoch, all ranks


def test_trainer_noise_scale_is_the_ddp_estimate_of_the_local_windows(ranks):
    *_, expected = _reference()
    for got in ranks:
        grad_norm_sq, trace_sigma, observations = got["full"]["noise"]
        assert observations == expected.observations == EPOCHS * N // (W * B * K)
        assert grad_norm_sq == pytest.approx(expected.grad_norm_sq, rel=1e-6)
        assert trace_sigma == pytest.approx(expected.trace_sigma, rel=1e-6)


def test_trainer_noise_scale_without_accumulation_measures_every_step(ranks):
    """gradient_accumulation_steps=1: DDP synchronises the run's first backward already, so
    DDPNoiseScale's hook is on the model before it (it was added after that backward, and the
    first window raised; so did a resume whose first microbatch closes a window)."""
    orders, _, expected = _reference(1)
    for got in ranks:
        grad_norm_sq, trace_sigma, observations = got["single"]["noise"]
        assert got["single"]["orders"] == orders
        assert observations == expected.observations == EPOCHS * N // (W * B)
        assert grad_norm_sq == pytest.approx(expected.grad_norm_sq, rel=1e-6)
        assert trace_sigma == pytest.approx(expected.trace_sigma, rel=1e-6)


def test_trainer_noise_scale_refuses_syncing_each_microbatch(ranks):
    for got in ranks:
        assert re.search(r"sync_each_batch.*own window gradient", got["single"]["sync_each_batch"])


@pytest.mark.parametrize("step", [2, 3, "end"])  # epoch 0's last step; mid-epoch 1; a run's end
def test_trainer_resumed_on_every_rank_from_rank_0s_checkpoint_is_exact(ranks, step):
    for got in ranks:
        full, resumed = got["full"], got["resumed"][step]
        assert resumed["orders"] == full["orders"]
        assert resumed["params"] == full["params"]
        assert resumed["noise"] == full["noise"]


def test_readme_accelerate_recipe_on_two_processes(ranks):
    readme = [got["readme"] for got in ranks]
    assert readme[0]["order"] == readme[1]["order"]  # one order for all ranks
    assert sorted(readme[0]["order"]) == list(range(256))
    for got in readme:
        assert got["replicas"] == W and got["epoch"] == 1
        assert got["stepped"] == 256 // W  # every example of this rank's share trained
        assert got["len"] == 256 // W // 16  # accelerate kept the sampler's split
    for got in ranks:
        assert "shard_by_sampler(loader)" in got["refused"]["error"]


def test_accelerate_partial_last_batches_train_the_samplers_split_and_resume_exactly(ranks):
    """Each rank trains its share of the padded epoch in batches of 4, 4 and 3 (accelerate's
    even_batches completed the 3 with the epoch's first example, and the step refused it), and
    load_state of rank 0's state at epoch 0's last update, inside epoch 1, or after a two-epoch
    run's loop ends bitwise with the uninterrupted run's orders and parameters on every rank."""
    full = [got["uneven"]["full"] for got in ranks]
    orders = full[0]["orders"]
    assert full[1]["orders"] == orders and len({tuple(order) for order in orders}) == 3
    for rank, got in enumerate(full):
        expected = []
        for epoch, order in enumerate(orders):
            padded = padded_order(torch.tensor(order), UNEVEN + 1, got["seed"], epoch)
            share = padded[rank::W].tolist()
            expected += [share[i : i + UB] for i in range(0, len(share), UB)]
        assert got["seen"] == expected
    for got in ranks:
        for step in (3, 5, 6):  # 6: after a two-epoch run's loop, continued
            resumed = got["uneven"][step]
            assert resumed["seen"] == got["uneven"]["full"]["seen"][step:]
            assert resumed["orders"] == got["uneven"]["full"]["orders"]
            assert resumed["params"] == got["uneven"]["full"]["params"]


def test_an_open_noise_window_saved_by_rank_0_is_refused_by_rank_1(ranks):
    """Each rank's state holds its own microbatches' squared norms while a window is open;
    rank 1 took rank 0's as its own (the continued estimate silently off: tr(Sigma) 3.58 where
    the uninterrupted run has 3.67) and now refuses it, naming the fix."""
    assert ranks[0]["uneven"]["noise"] == ""
    refusal = ranks[1]["uneven"]["noise"]
    assert re.search(r"saved by rank 0 inside a step.*rank 1.*own", refusal), refusal


def test_accelerate_dispatch_batches_is_refused_on_every_rank(ranks):
    """dispatch_batches=True: rank 0 alone draws from the loader (rank 1's share never trained)
    and hung in the sampler's first collective; shard_by_sampler refuses it on both ranks."""
    for got in ranks:
        assert "dispatch_batches=True" in got["uneven"]["dispatch"]["error"]
