"""A user's own data files read as the user meant them (issue 60): labels written several ways, JSON values that are
not texts, byte-order marks, ragged rows and misnamed delimiters, column flags, prediction files that round-trip
whatever the class names hold. The readers of examples/example_utils.py alone: no model, fast."""

from __future__ import annotations

import csv
import json
import logging
import re
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import example_utils as U


def _file(tmp_path: Path, name: str, text: str | bytes) -> str:
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8"))
    return str(path)


def _classes(path: str, **kwargs) -> tuple[list[str], list]:
    frame = U.read_table(path, **kwargs)
    names = U.label_names_of(frame, path)
    return names, U.encode_labels(frame, names, path)["label"].tolist()


# ---------------------------------------------------------------------------------------------------- predictions
AWKWARD_NAMES = ["line\nbreak", "tab\there", 'say "hi"', "NA", "01", "comma, too", "cr\r\nlf", "plain"]


def test_write_predictions_round_trips_whatever_the_class_names_hold(tmp_path):
    """One record per prediction: a class name with a line break, tab or quote is quoted as CSV quotes it."""
    predictions = [0, 1, 2, 3, 4, 5, 6, 7, 1, 0]
    path = U.write_predictions(tmp_path / "predict_results.txt", predictions, AWKWARD_NAMES, rows=range(3, 13))
    read = pd.read_csv(path, sep="\t", dtype=str, keep_default_na=False)
    assert list(read.columns) == ["index", "prediction"] and len(read) == len(predictions)
    assert read["index"].tolist() == [str(i) for i in range(3, 13)]
    assert read["prediction"].tolist() == [AWKWARD_NAMES[p] for p in predictions]
    with open(path, encoding="utf-8", newline="") as handle:
        records = list(csv.reader(handle, delimiter="\t"))
    assert records[1:] == [[str(i), AWKWARD_NAMES[p]] for i, p in zip(range(3, 13), predictions, strict=True)]
    plain = U.write_predictions(tmp_path / "plain.txt", [0, 1], ["neg", "pos"])
    assert plain.read_text() == "index\tprediction\n0\tneg\n1\tpos\n"  # run_glue's lines where nothing needs quotes


# ---------------------------------------------------------------------------------------------------- labels
@pytest.mark.parametrize(
    ("labels", "names", "ids"),
    [
        (["1", "1.0", "01", " 1", "2", "+2", "2e0"], ["1", "2"], [0, 0, 0, 0, 1, 1, 1]),
        (["pos", "pos ", " neg", "neg\t"], ["neg", "pos"], [1, 1, 0, 0]),
        (["01", "02", "10"], ["01", "02", "10"], [0, 1, 2]),  # one spelling each: kept as written
        (["1.0", "2.0"], ["1.0", "2.0"], [0, 1]),
        (["0.5", ".50", "1", "10", "2"], ["0.5", "1", "2", "10"], [0, 0, 1, 3, 2]),  # sorted by number
        (["12345678901234567890", "12345678901234567891"], ["12345678901234567890", "12345678901234567891"], [0, 1]),
        (["caf\u00e9", "cafe\u0301", "tea"], ["caf\u00e9", "tea"], [0, 0, 1]),  # one text in Unicode (NFC)
        (["b", "a", "10", "9"], ["10", "9", "a", "b"], [3, 2, 0, 1]),  # not all numbers: sorted as text
    ],
)
def test_a_label_written_several_ways_is_one_class(tmp_path, labels, names, ids):
    path = _file(tmp_path, "train.csv", "text,label\n" + "".join(f't{i},"{v}"\n' for i, v in enumerate(labels)))
    assert _classes(path) == (names, ids)


def test_merged_spellings_are_logged_with_the_file(tmp_path, caplog):
    path = _file(tmp_path, "train.csv", "text,label\na,1\nb,1.0\nc,pos\nd,pos \n")
    with caplog.at_level(logging.WARNING, logger=U.logger.name):
        U.label_names_of(U.read_table(path), path)
    assert re.search(r"train.csv: labels written several ways .*class '1' from '1', '1.0'; class 'pos' from 'pos ', "
                     r"'pos'", caplog.text)  # fmt: skip


def test_json_and_parquet_numbers_and_strings_name_one_class(tmp_path):
    rows = ('{"text": "a", "label": 1}\n{"text": "b", "label": "1"}\n{"text": "c", "label": 1.0}\n'
            '{"text": "d", "label": 2}\n')  # fmt: skip
    assert _classes(_file(tmp_path, "train.jsonl", rows)) == (["1", "2"], [0, 0, 0, 1])
    parquet = tmp_path / "train.parquet"
    pd.DataFrame({"text": ["a", "b", "c"], "label": [1.0, np.nan, 2.0]}).to_parquet(parquet)
    assert _classes(str(parquet), label_required=False) == (["1", "2"], [0, None, 1])
    booleans = '{"text": "a", "label": true}\n{"text": "b", "label": false}\n{"text": "c", "label": "true"}\n'
    assert _classes(_file(tmp_path, "bool.jsonl", booleans)) == (["false", "true"], [1, 0, 1])


def test_labels_that_differ_only_in_case_are_refused_naming_variants_rows_and_fix(tmp_path):
    path = _file(tmp_path, "train.csv", "text,label\na,pos\nb,Pos\nc,neg\nd,pos\n")
    message = (r"train.csv': the labels 'Pos' in 1 row\(s\) 1 \(0-based data rows; file lines 3\), 'pos' in 2 "
               r"row\(s\) 0, 3 \(0-based data rows; file lines 2, 5\) differ only in letter case: one class written "
               r"two ways, or 2 classes\? Write each class one way")  # fmt: skip
    with pytest.raises(ValueError, match=message):
        U.check_classes(U.read_table(path), path, "label")
    with pytest.raises(ValueError, match="differ only in letter case"):
        U.label_names_of(U.read_table(path))


def test_a_validation_label_in_another_case_names_the_close_class(tmp_path):
    path = _file(tmp_path, "dev.csv", "text,label\na,pos\nb,NEG\n")
    message = r"have labels \['NEG'\] that are not among the training labels \['neg', 'pos'\] \('NEG' differs from"
    with pytest.raises(ValueError, match=message):
        U.encode_labels(U.read_table(path), ["neg", "pos"], path)


def test_validation_and_test_labels_match_classes_by_the_same_rule(tmp_path):
    path = _file(tmp_path, "dev.csv", "text,label\na, 1.0\nb,02\nc,\n")
    frame = U.encode_labels(U.read_table(path, label_required=False), ["1", "2"], path)
    assert frame["label"].tolist() == [0, 1, None]
    as_written = U.encode_labels(U.read_table(path, label_required=False), ["1.0", "02"], path)
    assert as_written["label"].tolist() == [0, 1, None]


def test_class_names_that_name_one_class_twice_are_refused(tmp_path):
    """A set-up saved before labels were read by value may hold '1' and '1.0' as two classes: say so."""
    path = _file(tmp_path, "dev.csv", "text,label\na,1\n")
    with pytest.raises(ValueError, match=r"name one class twice, '1' and '1.0'.*fine-tune again"):
        U.encode_labels(U.read_table(path), ["1", "1.0"], path)


# ---------------------------------------------------------------------------------------------------- JSON values
def test_json_numbers_and_booleans_as_texts_are_read_as_written(tmp_path):
    rows = ['{"text": 12, "label": "a"}', '{"text": 1.50, "label": "b"}', '{"text": true, "label": "a"}',
            '{"text": 1e3, "label": "b"}', '{"text": "12", "label": "a"}']  # fmt: skip
    for name in ("data.jsonl", "data.json"):
        frame = U.read_table(_file(tmp_path, name, "\n".join(rows) + "\n"))
        assert frame["text"].tolist() == ["12", "1.50", "true", "1e3", "12"]
    array = _file(tmp_path, "array.json", "[" + ", ".join(rows) + "]")
    assert U.read_table(array)["text"].tolist() == ["12", "1.50", "true", "1e3", "12"]
    parquet = tmp_path / "numbers.parquet"
    pd.DataFrame({"text": [12, 7], "label": ["a", "b"]}).to_parquet(parquet)
    assert U.read_table(str(parquet))["text"].tolist() == ["12", "7"]


@pytest.mark.parametrize(
    ("line", "column", "kind"),
    [
        ('{"text": ["a", "b"], "label": "x"}', "text", "a list"),
        ('{"text": {"a": 1}, "label": "x"}', "text", "an object"),
        ('{"text": "fine", "label": ["x"]}', "label", "a list"),
        ('{"text": "fine", "label": {"x": 1}}', "label", "an object"),
    ],
)
def test_a_json_list_or_object_as_text_or_label_names_file_line_and_column(tmp_path, line, column, kind):
    path = _file(tmp_path, "data.jsonl", '{"text": "ok", "label": "y"}\n\n' + line + "\n")
    message = rf"data.jsonl': 1 row\(s\) 1 \(0-based data rows; file lines 3\) hold {kind} in column '{column}'"
    with pytest.raises(ValueError, match=message):
        U.read_table(path, label_required=False)


def test_json_lines_that_are_not_objects_or_repeat_a_key_are_named(tmp_path):
    with pytest.raises(ValueError, match=r"array.jsonl' is neither JSON lines .*line 1 holds an array.*read as .json"):
        U.read_frame(_file(tmp_path, "array.jsonl", '[{"text": "a"}]\n'))
    with pytest.raises(ValueError, match=r"twice.jsonl', line 2: the object names key\(s\) \['label'\] twice"):
        U.read_frame(_file(tmp_path, "twice.jsonl", '{"text": "a"}\n{"text": "b", "label": 1, "label": 2}\n'))
    with pytest.raises(ValueError, match=r"broken.jsonl' is neither JSON lines .*line 2, column 14: Expecting"):
        U.read_frame(_file(tmp_path, "broken.jsonl", '{"text": "a"}\n{"text": "b" "label": 1}\n'))


# ---------------------------------------------------------------------------------------------------- encodings
@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("bom.csv", "text,label\r\nfine,pos\r\nbad,neg\r\n"),
        ("bom.tsv", "text\tlabel\nfine\tpos\nbad\tneg\n"),
        ("bom.jsonl", '{"text": "fine", "label": "pos"}\n{"text": "bad", "label": "neg"}\n'),
        ("bom.json", '[{"text": "fine", "label": "pos"}, {"text": "bad", "label": "neg"}]'),
    ],
)
def test_a_utf8_byte_order_mark_is_accepted(tmp_path, name, text):
    path = _file(tmp_path, name, b"\xef\xbb\xbf" + text.encode("utf-8"))
    frame = U.read_table(path)
    assert frame["text"].tolist() == ["fine", "bad"] and frame["label"].tolist() == ["pos", "neg"]


def test_a_utf16_file_is_named_as_such(tmp_path):
    path = _file(tmp_path, "excel.csv", "text,label\nfine,pos\n".encode("utf-16"))
    with pytest.raises(ValueError, match=r"excel.csv' is UTF-16 text .*iconv -f utf-16"):
        U.read_table(path)


# ---------------------------------------------------------------------------------------------------- ragged rows
@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("data.csv", "text,label\na,pos\nb,neg\nwell, fine,pos\n",
         r"data.csv': line 4 has 3 field\(s\) where the header \(line 1\) has 2 \['text', 'label'\]: a text that holds "
         r'a comma must be quoted \("a, b"\)'),
        ("tabs.csv", "text\tlabel\nfine\tpos\nwell, really, fine\tpos\n",
         r"tabs.csv': line 3 has 3 field\(s\) .*this looks tab-separated: name it .tsv"),
        ("short.csv", "text,label,source\na,pos,web\nb,neg\n",
         r"short.csv': line 3 has 2 field\(s\) where the header \(line 1\) has 3 .*one field per column"),
        ("trailing.csv", "text,label\na,pos,\nb,neg,\n",
         r"line 2 has 3 field\(s\).*a delimiter at the end of the line"),
        ("tab.tsv", "text\tlabel\na\tpos\nsplit\ttext\tneg\n",
         r"tab.tsv': line 3 has 3 field\(s\) .*a tab inside a text splits its row"),
        ("commas.tsv", "text,label\nfine,pos\n", r"no column\(s\) \['text', 'label'\].*this looks comma-separated"),
        ("onecol.csv", "text\tlabel\nfine\tpos\n", r"no column\(s\) \['text', 'label'\].*this looks tab-separated"),
        ("quoted.csv", 'text,label\n"a,pos\nb,neg\n',
         r"quoted.csv': line 2 has 1 field\(s\) .*opens a quoted cell that runs on to line 3: close the quote"),
        ("semicolons.csv", "text;label\nfine;pos\n", r"no column\(s\).*this looks semicolon-separated"),
        ("semicolons.csv", "text;label\nfine, really;pos\n",
         r"line 2 has 2 field\(s\) .*this looks semicolon-separated"),
        ("twice.csv", "text,label,label\na,pos,neg\n",
         r"twice.csv': the header \(line 1\) names column\(s\) \['label'\] more than once"),
    ],
)  # fmt: skip
def test_ragged_rows_and_misnamed_delimiters_name_file_line_and_fix(tmp_path, name, text, message):
    with pytest.raises(ValueError, match=message):
        U.read_table(_file(tmp_path, name, text))


def test_windows_line_endings_blank_lines_and_quoted_line_breaks_keep_every_row(tmp_path):
    text = 'text,label\r\n"two\r\nlines",pos\r\n\r\nNA,neg\r\n"",pos\r\n"say ""hi""",neg\r\n'
    path = _file(tmp_path, "windows.csv", text)
    frame = U.read_table(path)
    assert frame["text"].tolist() == ["two\r\nlines", "NA", "", 'say "hi"'] and frame.index.tolist() == [0, 1, 2, 3]
    assert U.line_numbers(path) == [2, 5, 6, 7]


def test_a_text_longer_than_csvs_default_field_limit_is_read(tmp_path):
    long = "word " * 40_000  # 200,000 characters
    frame = U.read_table(_file(tmp_path, "long.csv", f"text,label\n{long},pos\nshort,neg\n"))
    assert frame["text"].str.len().tolist() == [len(long), 5]


# ---------------------------------------------------------------------------------------------------- columns
def test_text_column_equal_to_label_column_names_both_flags(tmp_path):
    path = _file(tmp_path, "data.csv", "text,label\na,pos\n")
    with pytest.raises(ValueError, match=r"--text_column and --label_column both name column 'label' of .*data.csv"):
        U.read_table(path, text_column="label")
    with pytest.raises(ValueError, match=r"--text_column \(by default\) and --label_column both name column 'text'"):
        U.read_table(path, label_column="text")


def test_a_missing_column_names_file_column_columns_found_flag_and_close_match(tmp_path):
    path = _file(tmp_path, "data.csv", "Text, Label\na,pos\n")
    message = (r"data.csv' has no column\(s\) \['text', 'label'\] \(--text_column and --label_column\); its columns "
               r"are \['Text', ' Label'\]. Close matches \(case or surrounding spaces\): 'Text' for 'text', ' Label' "
               r"for 'label'. Set --text_column and --label_column")  # fmt: skip
    with pytest.raises(ValueError, match=message):
        U.read_table(path)
    with pytest.raises(ValueError, match=r"no column\(s\) \['label'\] \(--label_column\)"):
        U.read_table(path, text_column="Text")


def test_a_header_column_without_a_name_is_kept(tmp_path):
    frame = U.read_frame(_file(tmp_path, "data.csv", "text,label,,\na,pos,,\n"))
    assert list(frame.columns) == ["text", "label", "Unnamed: 2", "Unnamed: 3"] and len(frame) == 1


def test_json_texts_in_a_pandas_columns_document_and_a_single_object(tmp_path):
    columns = pd.DataFrame({"text": ["a", "NA"], "label": ["x", "y"]}).to_json()
    assert U.read_table(_file(tmp_path, "columns.json", columns))["text"].tolist() == ["a", "NA"]
    lists = json.dumps({"text": ["a", "b"], "label": ["x", "y"]})
    assert U.read_table(_file(tmp_path, "lists.json", lists))["label"].tolist() == ["x", "y"]
    one = json.dumps({"text": "a", "label": "x"}, indent=2)
    assert U.read_table(_file(tmp_path, "one.json", one))["text"].tolist() == ["a"]


def test_k_shot_names_a_short_class_by_its_name(tmp_path):
    path = _file(tmp_path, "train.csv", "text,label\na,pos\nb,neg\nc,neg\n")
    frame = U.encode_labels(U.read_table(path), ["neg", "pos"])
    with pytest.raises(ValueError, match=r"k_shot=2 exceeds the number of examples of class\(es\) \{'pos': 1\}"):
        U.k_shot(frame, 2, seed=0, label_names=["neg", "pos"])
    assert sorted(U.k_shot(frame, 1, seed=0)["label"]) == [0, 1]
