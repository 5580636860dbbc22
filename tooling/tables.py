"""
Runs tables: the CSV files the fits read (one row per measured point) and the ones the ladder writes.

Guards against: a CSV that would be read wrong in silence or fail deep inside a fit. A missing, blank,
duplicate or ambiguous column, a row with too few or too many fields (an unquoted comma shifts every
column after it), an empty cell, a value that is not a finite number or out of its range, a quoted value
spanning lines, a quote left open and bytes that are not UTF-8 each raise one ValueError naming the file,
the line and the column; a spreadsheet's UTF-8 byte-order mark is accepted. A row that repeats an earlier
row in every column the reader returns (the same point pasted twice, which a fit would count twice) is
refused with both line numbers; rows that differ in any returned column (repeated seeds differ in loss)
are kept. Files are written atomically
(tooling.common.write_atomic), so a reader never sees half a table. numpy and the standard library only.

    runs = read_runs_csv("runs.csv", ["arch", "C", "loss"], positive=["C", "loss"])  # {column: array}
    write_runs_csv(runs, "copy.csv")               # {column: array} -> CSV
    write_rows_csv("out/runs.csv", [dict(arch="vanilla", C=1e18, loss=3.1), ...])   # list of dicts -> CSV
    read_rows_csv("out/runs.csv")                  # and back: the same list of dicts
    read_chinchilla_csv("tests/data/chinchilla_fig4_epoch.csv")    # N, D, loss (from N,C / params,train_flops)
    read_power_csv("tests/data/fineweb_ladders.csv")   # arch, C, loss[, depth] (from arm, compute_flops, val_loss)
    refuse_case_variants("runs.csv", list(runs["arch"]), "arch")  # 'Vanilla' and 'vanilla': refused, both lines
    data_lines("runs.csv")                         # the line each data row starts on, to name it in an error
"""

import csv
import io
import math

import numpy as np

from tooling.common import write_atomic


def read_runs_csv(path, required, numeric=(), positive=(), fraction=(), alternatives=None, optional=()):
    """Read a CSV with a header row into {column: np.ndarray}. `required` columns must be present
    (or one of `alternatives[col]`), `optional` ones (or an alternative) are read when present,
    `numeric` ones parse as finite floats, `positive` ones are > 0, `fraction` ones lie in [0, 1); other
    columns are ignored. A column is returned under the name the file gives it. A file that cannot be
    opened raises OSError; anything wrong inside it raises ValueError naming the file, the line and the
    column; a row equal to an earlier one in every returned column, naming both lines (_refuse_duplicate)."""
    with open(path, "rb") as f:
        raw = f.read()
    lines = _csv_lines(path, _decode_utf8(path, raw))
    header = _header(path, lines, required)
    alternatives = alternatives or {}
    present = [name for name in optional if any(o in header for o in [name, *alternatives.get(name, ())])]
    columns = _required_columns(path, header, [*required, *present], alternatives)
    numbers = set(numeric) | set(positive) | set(fraction)
    data = {name: [] for name in columns}
    seen = {}  # the values of every returned column -> the line they were first read on
    for lineno, row in lines[1:]:
        if not any(cell.strip() for cell in row):
            continue  # blank line
        if len(row) != len(header):  # a shifted row (e.g. an unquoted comma) would read wrong columns
            raise ValueError(f"{path} line {lineno}: {len(row)} fields, the header has {len(header)}")
        for name, col in columns.items():
            where = f"{path} line {lineno}, column '{name}'"
            cell = _text_cell(where, row[col])
            if name in numbers:
                data[name].append(_number_cell(where, cell, name in positive, name in fraction))
            else:
                data[name].append(cell)
        _refuse_duplicate(path, seen, tuple(data[name][-1] for name in columns), lineno, list(columns))
    if not next(iter(data.values())):
        raise ValueError(f"{path}: no data rows after the header")
    return {k: np.asarray(v, dtype=float if k in numbers else object) for k, v in data.items()}


def refuse_case_variants(path, names, column):
    """One name spelled two ways ('Vanilla', 'vanilla') would split its points into two architectures (or
    cells): a ValueError naming both lines. names: the column's values as read_runs_csv returned them."""
    first = {}
    for i, name in enumerate(names):
        j = first.setdefault(name.casefold(), i)
        if names[j] != name:
            lines = data_lines(path)
            raise ValueError(f"{path} line {lines[i]}, column '{column}': '{name}' and '{names[j]}' (line {lines[j]}) "
                             "differ only in case; spell the name one way")


def data_lines(path):
    """The line each data row of a CSV starts on (blank rows skipped, as read_runs_csv skips them)."""
    with open(path, "rb") as f:
        rows = _csv_lines(path, _decode_utf8(path, f.read()))
    return [lineno for lineno, row in rows[1:] if any(cell.strip() for cell in row)]


def _refuse_duplicate(path, seen, key, lineno, names):
    """Remember key (a row's values in the columns `names`) as read on lineno; the second time, a
    ValueError naming both lines. Numbers compare as values: 1e18 and 1.0e18 are the same point."""
    if key in seen:
        raise ValueError(f"{path} lines {seen[key]} and {lineno}: the same row twice (equal {', '.join(names)}); "
                         "a fit would count that point twice: delete one of them")
    seen[key] = lineno


def _decode_utf8(path, raw):
    """The text of a file's bytes by the codec "utf-8-sig" (a spreadsheet's UTF-8 byte-order mark dropped),
    with the line and byte of the first invalid byte in the error."""
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        data, at = e.object, e.start  # the bytes after the mark, if there was one
        lineno, line_start = data.count(b"\n", 0, at) + 1, data.rfind(b"\n", 0, at) + 1
        raise ValueError(f"{path} line {lineno}: not valid UTF-8 (byte 0x{data[at]:02x} at byte {at - line_start + 1} "
                         "of the line); save the file as UTF-8 CSV") from None


def _csv_lines(path, text):
    """[(line number the row starts on, fields)] of a CSV text: a quoted field may span lines."""
    reader = csv.reader(io.StringIO(text, newline=""), strict=True)
    lines, end = [], 0
    try:
        for row in reader:
            lines.append((end + 1, row))
            end = reader.line_num
    except csv.Error as e:  # e.g. a quote left open, or text after a closing quote
        raise ValueError(f"{path} line {end + 1}: malformed CSV ({e})") from None
    return lines


def _header(path, lines, required):
    """The stripped column names of the first row; an empty file, a blank first row or a column name
    given twice is a ValueError."""
    if not any(cell.strip() for _, row in lines for cell in row):
        raise ValueError(f"{path}: empty file, expected a header row with columns {','.join(required)}")
    if not any(cell.strip() for cell in lines[0][1]):
        raise ValueError(f"{path} line 1: blank, expected a header row with columns {','.join(required)}")
    header = [h.strip() for h in lines[0][1]]
    first = {}
    for col, name in enumerate(header, start=1):
        if name and name in first:
            raise ValueError(f"{path} line 1, column {col}: duplicate column name '{name}' (also column {first[name]})")
        first.setdefault(name, col)
    return header


def _required_columns(path, header, required, alternatives):
    """{column name found: its index} for every required column (under its own name or exactly one of
    its alternatives)."""
    columns = {}
    for name in required:
        options = [name] + list(alternatives.get(name, ()))
        found = [o for o in options if o in header]
        if not found:
            raise ValueError(f"{path} line 1: missing column '{name}'"
                             + (f" (or {' / '.join(repr(o) for o in options[1:])})" if len(options) > 1 else "")
                             + f"; header is: {','.join(header)}")
        if len(found) > 1:
            raise ValueError(f"{path} line 1: columns {' and '.join(repr(o) for o in found)} both given for "
                             f"'{name}'; keep one")
        columns[found[0]] = header.index(found[0])
    return columns


def _text_cell(where, cell):
    cell = cell.strip()
    if cell == "":
        raise ValueError(f"{where}: empty value")
    if "\n" in cell or "\r" in cell:
        raise ValueError(f"{where}: a quoted value spans several lines")
    return cell


def _number_cell(where, cell, positive, fraction):
    try:
        value = float(cell)
    except ValueError:
        raise ValueError(f"{where}: '{cell}' is not a number") from None
    if not math.isfinite(value):
        raise ValueError(f"{where}: value must be finite, got '{cell}'")
    if positive and value <= 0:
        raise ValueError(f"{where}: must be > 0, got {cell}")
    if fraction and not 0 <= value < 1:
        raise ValueError(f"{where}: must lie in [0, 1), got {cell}")
    return value


def read_chinchilla_csv(path):
    """N,D,loss or N,C,loss (D = C / 6N); Epoch AI's column names params / train_flops are accepted too.
    Returns {"N": array, "D": array, "loss": array}."""
    runs = read_runs_csv(path, ["N", "D", "loss"], positive=["N", "params", "D", "C", "train_flops", "loss"],
                         alternatives={"N": ["params"], "D": ["C", "train_flops"]})
    if "params" in runs:
        runs["N"] = runs.pop("params")
    for name in ("C", "train_flops"):
        if name in runs:
            runs["D"] = runs.pop(name) / (6 * runs["N"])  # C = 6 N D
    return runs


POWER_ALTERNATIVES = {"arch": ["arm"], "C": ["compute_flops"], "loss": ["val_loss"]}  # [X]'s released ladders


def read_power_csv(path):
    """arch, C, loss and, when the file has it, depth: the columns `fit.py power` reads. The [X] paper's
    released ladders (tests/data/fineweb_ladders.csv: arm, depth, compute_flops, val_loss) are read under
    those names. Returns {"arch": array, "C": array, "loss": array[, "depth": array]}."""
    runs = read_runs_csv(path, ["arch", "C", "loss"], positive=["C", "loss", "depth", "compute_flops", "val_loss"],
                         alternatives=POWER_ALTERNATIVES, optional=["depth"])
    for name, others in POWER_ALTERNATIVES.items():
        for other in others:
            if other in runs:
                runs[name] = runs.pop(other)
    return {k: runs[k] for k in ("arch", "C", "loss", "depth") if k in runs}


def write_runs_csv(runs, path):
    """Write {column: array} (e.g. fit.synthetic_surface_runs()) as a CSV with a header, atomically.
    Floats are written with 10 significant digits."""
    cols = list(runs)
    text = io.StringIO()
    w = csv.writer(text, lineterminator="\n")
    w.writerow(cols)
    for row in zip(*(runs[c] for c in cols)):
        w.writerow([f"{v:.10g}" if isinstance(v, (float, np.floating)) else v for v in row])
    write_atomic(path, lambda f: f.write(text.getvalue().encode("utf-8")))


def write_rows_csv(path, rows):
    """Write a list of dicts as a CSV, atomically: the union of the rows' keys (first-seen order) is the
    header, a missing or None value an empty cell, floats as Python prints them (exact round trip)."""
    columns = list(dict.fromkeys(k for r in rows for k in r))
    buffer = io.StringIO()
    w = csv.DictWriter(buffer, fieldnames=columns)
    w.writeheader()
    for r in rows:
        w.writerow({k: ("" if r.get(k) is None else r[k]) for k in columns})
    write_atomic(path, lambda f: f.write(buffer.getvalue().encode()))


def read_rows_csv(path, unique=None):
    """What write_rows_csv wrote, back as a list of dicts: an empty cell is None, True / False are bools,
    a number is an int when it is written as one and a float otherwise, anything else a string. Errors
    (bytes, quoting, a row with the wrong number of fields, a nan or inf number) name the file, the line
    and the column. unique: the columns that identify a row (e.g. run_id); two rows equal in all of them
    are refused, naming both lines. Default (or when the header has none of them): every column."""
    with open(path, "rb") as f:
        lines = _csv_lines(path, _decode_utf8(path, f.read()))
    if not lines:
        raise ValueError(f"{path}: empty file, expected a header row")
    header = _header(path, lines, [])
    keys = [name for name in (unique or ()) if name in header] or header
    rows, seen = [], {}
    for lineno, row in lines[1:]:
        if not any(cell.strip() for cell in row):
            continue
        if len(row) != len(header):
            raise ValueError(f"{path} line {lineno}: {len(row)} fields, the header has {len(header)}")
        rows.append({name: _typed(f"{path} line {lineno}, column '{name}'", cell) for name, cell in zip(header, row)})
        _refuse_duplicate(path, seen, tuple(rows[-1][name] for name in keys), lineno, keys)
    return rows


def _typed(where, cell):
    if cell == "":
        return None
    if cell in ("True", "False"):
        return cell == "True"
    for kind in (int, float):
        try:
            value = kind(cell)
        except ValueError:
            continue
        if not math.isfinite(value):  # float("nan"), float("inf"): no fit or report can use one
            raise ValueError(f"{where}: value must be finite, got '{cell}'")
        return value
    return cell
