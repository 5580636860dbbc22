# tooling/tables.py: runs CSV files read with errors naming the file, the line and the column (a byte-order
# mark accepted), Chinchilla column aliases, and the atomic writers. fit.py's CLI on top: tests/test_fit.py.
import hashlib
import os
import re

import numpy as np
import pytest

import fit
from tooling import tables

DATA = os.path.join(os.path.dirname(__file__), "data", "chinchilla_fig4_epoch.csv")
POWER_EXAMPLE = os.path.join(os.path.dirname(__file__), "data", "power_example.csv")  # fit.synthetic_power_runs()
X_LADDERS = os.path.join(os.path.dirname(__file__), "data", "fineweb_ladders.csv")  # [X]'s released ladders
X_LADDERS_SHA256 = "94e787a140c3094981d82779d9c75c971f40a541970bcfbbdee0e8292d730e2c"  # tests/data/README_fineweb.md
POWER_COLUMNS = dict(required=["arch", "C", "loss"], positive=["C", "loss"])


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def read_power(path):
    return tables.read_runs_csv(path, POWER_COLUMNS["required"], positive=POWER_COLUMNS["positive"])


POWER_HEAD = "arch,C,loss\n"
POWER_OK = "".join(f"v,{c:g},{2 + 1.5 * (c / 1e18) ** -0.3:.6f}\n" for c in (1e18, 3e18, 1e19, 3e19, 1e20))


@pytest.mark.parametrize("text, message", [
    ("", "power.csv: empty file, expected a header row with columns arch,C,loss"),
    ("\n\n", "power.csv: empty file"),
    ("\n" + POWER_HEAD + POWER_OK, "power.csv line 1: blank, expected a header row"),
    (POWER_HEAD, "power.csv: no data rows after the header"),
    (POWER_HEAD + "\n \n", "power.csv: no data rows after the header"),
    ("arch,C,loss,C\n" + POWER_OK.replace("\n", ",1\n"), "power.csv line 1, column 4: duplicate column name 'C' (also column 2)"),
    ("arch,loss\nv,2.0\n", "power.csv line 1: missing column 'C'; header is: arch,loss"),
    (POWER_HEAD + POWER_OK + "v,abc,2.0\n", "power.csv line 7, column 'C': 'abc' is not a number"),
    (POWER_HEAD + POWER_OK + "v,1e21,nan\n", "power.csv line 7, column 'loss': value must be finite, got 'nan'"),
    (POWER_HEAD + POWER_OK + "v,inf,2.0\n", "power.csv line 7, column 'C': value must be finite, got 'inf'"),
    (POWER_HEAD + "v,-1e18,2.0\n" + POWER_OK, "power.csv line 2, column 'C': must be > 0, got -1e18"),
    (POWER_HEAD + POWER_OK + "v,1e21,0\n", "power.csv line 7, column 'loss': must be > 0, got 0"),
    (POWER_HEAD + POWER_OK + "v,,2.0\n", "power.csv line 7, column 'C': empty value"),
    (POWER_HEAD + POWER_OK + ",1e21,2.0\n", "power.csv line 7, column 'arch': empty value"),
    (POWER_HEAD + POWER_OK + "v,1e21,2.0,x\n", "power.csv line 7: 4 fields, the header has 3"),
    (POWER_HEAD + POWER_OK + "v,1e21\n", "power.csv line 7: 2 fields, the header has 3"),
    (POWER_HEAD + "\n" + POWER_OK + 'v,1e21,"2.0\n', "power.csv line 8: malformed CSV (unexpected end of data)"),
    (POWER_HEAD + POWER_OK + 'v,"1e21\n2",2.0\n', "power.csv line 7, column 'C': a quoted value spans several lines"),
])
def test_malformed_runs_csv_names_file_line_and_column(tmp_path, text, message):
    path = write(tmp_path, "power.csv", text)
    with pytest.raises(ValueError) as e:
        read_power(path)
    assert message in str(e.value) and str(e.value).startswith(path), str(e.value)
    assert "\n" not in str(e.value)  # one line on the command line


def test_blank_lines_and_extra_columns_are_skipped(tmp_path):
    path = write(tmp_path, "power.csv", "arch, C ,loss,note\n\n" + POWER_OK.replace("\n", ",x\n") + ",,,\n \n")
    runs = read_power(path)
    assert set(runs) == {"arch", "C", "loss"} and len(runs["C"]) == 5  # header names are stripped
    assert runs["C"].dtype == float and runs["arch"].dtype == object and list(runs["arch"]) == ["v"] * 5


def test_fraction_and_numeric_columns(tmp_path):
    path = write(tmp_path, "s.csv", "S,x\n0.5,-3\n0,0\n")
    runs = tables.read_runs_csv(path, ["S", "x"], numeric=["x"], fraction=["S"])
    np.testing.assert_array_equal(runs["S"], [0.5, 0.0])
    np.testing.assert_array_equal(runs["x"], [-3.0, 0.0])  # numeric: any finite number
    with pytest.raises(ValueError, match=r"s.csv line 2, column 'S': must lie in \[0, 1\), got 1"):
        tables.read_runs_csv(write(tmp_path, "s.csv", "S\n1\n"), ["S"], fraction=["S"])


def test_missing_file_is_an_os_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_power(str(tmp_path / "no-such.csv"))


def test_non_utf8_csv_names_line_and_byte(tmp_path):
    path = tmp_path / "latin1.csv"
    path.write_bytes(("arch,C,loss\nv,1e18,3.5\nvanilla_caf\u00e9,1e19,2.7\n").encode("latin-1"))  # é is byte 12 of line 3
    with pytest.raises(ValueError, match=r"latin1.csv line 3: not valid UTF-8 \(byte 0xe9 at byte 12 of the line\)"):
        read_power(str(path))


def test_csv_with_byte_order_mark(tmp_path):
    # spreadsheet programs write a UTF-8 byte-order mark before the header: it is not part of 'params'
    bom = tmp_path / "bom.csv"
    bom.write_bytes(b"\xef\xbb\xbf" + open(DATA, "rb").read())
    plain, marked = tables.read_chinchilla_csv(DATA), tables.read_chinchilla_csv(str(bom))
    for k in ("N", "D", "loss"):
        np.testing.assert_array_equal(plain[k], marked[k])
    power = tmp_path / "power_bom.csv"
    power.write_bytes(b"\xef\xbb\xbf" + open(POWER_EXAMPLE, "rb").read())
    plain, marked = read_power(POWER_EXAMPLE), read_power(str(power))
    assert list(marked["arch"]) == list(plain["arch"]) and set(marked["arch"]) == {"vanilla", "loop-2", "untied-grow"}
    np.testing.assert_array_equal(marked["loss"], plain["loss"])


def test_chinchilla_columns_and_aliases(tmp_path):
    runs = tables.read_chinchilla_csv(DATA)  # Epoch AI's params, train_flops -> N, D = C / (6N)
    assert set(runs) == {"N", "D", "loss"} and len(runs["loss"]) == 245
    by_c = tables.read_chinchilla_csv(write(tmp_path, "c.csv", "N,C,loss\n1e9,6e19,2.0\n"))
    np.testing.assert_allclose(by_c["D"], [1e10])  # D = C / 6N
    by_d = tables.read_chinchilla_csv(write(tmp_path, "d.csv", "N,D,loss\n1e9,1e10,2.0\n"))
    np.testing.assert_array_equal(by_d["D"], [1e10])


@pytest.mark.parametrize("header, message", [
    ("N,D,C,loss", "line 1: columns 'D' and 'C' both given for 'D'"),
    ("N,params,D,loss", "line 1: columns 'N' and 'params' both given for 'N'"),
    ("N,D,loss,N", "line 1, column 4: duplicate column name 'N' (also column 1)"),
    ("N,loss", "line 1: missing column 'D' (or 'C' / 'train_flops')"),
])
def test_ambiguous_chinchilla_columns(tmp_path, header, message):
    n = header.count(",") + 1
    path = write(tmp_path, "c.csv", header + "\n" + ",".join(["1e9"] * (n - 1) + ["2.0"]) + "\n")
    with pytest.raises(ValueError) as e:
        tables.read_chinchilla_csv(path)
    assert message in str(e.value) and path in str(e.value)


def test_write_runs_csv_round_trips_and_writes_the_shipped_example(tmp_path):
    runs = fit.synthetic_surface_runs(seed=3)
    path = str(tmp_path / "out" / "runs.csv")
    tables.write_runs_csv(runs, path)
    assert os.listdir(tmp_path / "out") == ["runs.csv"]  # atomic: no temp file left beside it
    back = tables.read_runs_csv(path, list(runs), positive=["F", "D", "loss"], fraction=["S"])
    for k in ("arch", "cell"):
        assert list(back[k]) == list(runs[k])
    for k in ("F", "S", "D", "loss"):
        np.testing.assert_allclose(back[k], runs[k], rtol=1e-9)  # 10 significant digits
    # tests/data/power_example.csv is write_runs_csv(synthetic_power_runs()), byte for byte
    tables.write_runs_csv(fit.synthetic_power_runs(), str(tmp_path / "power.csv"))
    assert (tmp_path / "power.csv").read_bytes() == open(POWER_EXAMPLE, "rb").read()


def test_write_rows_csv_unions_the_keys_and_leaves_none_empty(tmp_path):
    rows = [dict(arch="a", loss=2.5, seed=1), dict(arch="b", loss=None, extra=0.1 + 0.2)]
    path = str(tmp_path / "runs.csv")
    tables.write_rows_csv(path, rows)
    assert open(path, newline="").read() == "arch,loss,seed,extra\r\na,2.5,1,\r\nb,,,0.30000000000000004\r\n"
    assert os.listdir(tmp_path) == ["runs.csv"]


def test_read_rows_csv_gives_back_what_write_rows_csv_wrote(tmp_path):
    rows = [dict(arch="vanilla", depth=3, C=1.9778627e11, loss=2.08075990755043, grow_step=None, carried=True),
            dict(arch="loop-2", depth=4, C=0.1 + 0.2, loss=1.5, grow_step=12, carried=False, extra="d4")]
    path = str(tmp_path / "runs.csv")
    tables.write_rows_csv(path, rows)
    back = tables.read_rows_csv(path)
    assert back == [dict(r, extra=r.get("extra")) for r in rows]  # a key missing from a row reads as None
    assert [type(v) for v in back[1].values()] == [str, int, float, float, int, bool, str]
    with pytest.raises(ValueError, match="line 3: 2 fields, the header has 3"):
        tables.read_rows_csv(write(tmp_path, "bad.csv", "a,b,c\n1,2,3\n1,2\n"))


# ----------------------------------------------------------------------------- fit.py power's columns

def test_read_power_csv_reads_the_x_ladders_under_our_names():
    raw = open(X_LADDERS, "rb").read()
    assert hashlib.sha256(raw).hexdigest() == X_LADDERS_SHA256  # byte for byte the released file (CRLF lines)
    assert raw.count(b"\r\n") == 59 and raw.startswith(b"arm,depth,compute_flops,val_loss\r\n")
    runs = tables.read_power_csv(X_LADDERS)
    assert list(runs) == ["arch", "C", "loss", "depth"] and len(runs["C"]) == 58
    assert (runs["arch"][0], runs["depth"][0], runs["C"][0], runs["loss"][0]) == ("vanilla", 6.0, 3.252671e17, 3.560862)
    assert runs["arch"][-1] == "untied_grow" and len(set(runs["arch"])) == 8


def test_read_power_csv_depth_is_optional_and_names_are_unambiguous(tmp_path):
    assert list(tables.read_power_csv(POWER_EXAMPLE)) == ["arch", "C", "loss"]
    mixed = write(tmp_path, "mixed.csv", "arm,C,val_loss,depth\n" + POWER_OK.replace("\n", ",8\n"))
    runs = tables.read_power_csv(mixed)  # our names and [X]'s may be mixed, each column once
    assert list(runs) == ["arch", "C", "loss", "depth"] and np.all(runs["depth"] == 8)
    for text, message in [
        ("arch,arm,C,loss\n" + POWER_OK.replace("v,", "v,v,"), "columns 'arch' and 'arm' both given for 'arch'"),
        ("arch,compute,loss\n" + POWER_OK, "missing column 'C' (or 'compute_flops')"),
        ("arch,C,loss,depth\n" + POWER_OK.replace("\n", ",deep\n"), "line 2, column 'depth': 'deep' is not a number"),
        ("arm,depth,compute_flops,val_loss\nv,6,-1e18,3.5\n", "line 2, column 'compute_flops': must be > 0"),
    ]:
        path = write(tmp_path, "bad.csv", text)
        with pytest.raises(ValueError, match=re.escape(message)):
            tables.read_power_csv(path)


def test_a_row_repeated_in_every_read_column_is_refused_with_both_lines(tmp_path):
    # numbers compare as values (3e18 = 3.0e18); a column the reader ignores does not make two rows different
    path = write(tmp_path, "p.csv", "arch,C,loss,note\nv,1e18,3.0,a\nv,3e18,2.5,a\nv,3.0e18,2.5,b\n")
    with pytest.raises(ValueError, match=re.escape("p.csv lines 3 and 4: the same row twice (equal arch, C, loss)")):
        read_power(path)
    # the same arch and C with another loss is a repeated seed, kept
    kept = read_power(write(tmp_path, "seeds.csv", "arch,C,loss\nv,1e18,3.0\nv,1e18,3.1\n"))
    assert list(kept["loss"]) == [3.0, 3.1]


def test_read_rows_csv_refuses_nan_inf_and_repeated_rows(tmp_path):
    with pytest.raises(ValueError, match=re.escape("r.csv line 3, column 'loss': value must be finite, got 'nan'")):
        tables.read_rows_csv(write(tmp_path, "r.csv", "run_id,loss\na,2.0\nb,nan\n"))
    with pytest.raises(ValueError, match=re.escape("r.csv line 2, column 'C': value must be finite, got '-inf'")):
        tables.read_rows_csv(write(tmp_path, "r.csv", "run_id,C\na,-inf\n"))
    twice = write(tmp_path, "r.csv", "run_id,loss\na,2.0\nb,2.1\na,2.2\n")
    assert len(tables.read_rows_csv(twice)) == 3  # every column: the rows differ
    with pytest.raises(ValueError, match=re.escape("r.csv lines 2 and 4: the same row twice (equal run_id)")):
        tables.read_rows_csv(twice, unique=["run_id"])
    with pytest.raises(ValueError, match="lines 2 and 3: the same row twice"):
        tables.read_rows_csv(write(tmp_path, "r.csv", "run_id,loss\na,2.0\na,2.0\n"))
    assert tables.read_rows_csv(write(tmp_path, "r.csv", "arch,name\nv,nano\n"))[0]["name"] == "nano"  # text stays text
