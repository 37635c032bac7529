"""The vision matrix: for each family of tests/vision_models.py, the checks of tests/fast/test_vision.py on its tiny
random model in fp32, each a verdict of its own, and for each family the server refuses at start
(app/models/vision.py's UNSERVED), the reason it gives.

Each row must equal the one recorded in docs/results/vision-matrix.json, from which docs/models.md's vision table
is generated (benchmarks/models_table.py; tests/fast/test_docs.py checks the page). A family added, refused, or
served differently fails here until it is recorded: `RECORD_VISION_MATRIX=1 pytest tests/fast/test_vision_matrix.py`,
then `make docs-figures`.

The cells: `alone`, `amid text` (one packed pass with three text-only requests), `amid image` (one pass with another
image's request, of another size) and `two images` (in one request): `exact` when the engine's greedy tokens are
`generate()`'s on the processor's inputs. `prefix cache`: the same prompt with the same image again starts from
the first's cached blocks past its last placeholder, the same prompt with another image of the same size never past
its first, and both answers are `generate()`'s; and in a two-image request, changing either image changes the
prompt's cache keys at or before that image's first placeholder: `exact, keyed by pixels`; `off: sliding window`
where sliding-window layers turn the prefix cache off, as for a text model. `checkpoint`: the family saved as its
hub checkpoints are laid out loads through the server's loader, its processor prepares what the original does, and
the loaded model's tokens are `generate()`'s: `loads, exact`. A refused family's row is `refused: <why>`.
"""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path

import pytest
import torch

from app.core.engine.prefix_cache import keeps_all_keys
from app.models.loading import LoadedModel, load_model
from app.models.vision import UNSERVED, VisionEncoder, text_model, vision_problem
from engine_runs import run_engine
from test_vision import GREEDY, chat, picture, reference, request
from vision_models import FAMILIES, build, save_checkpoint

pytestmark = pytest.mark.full  # the checks of test_vision.py again, per column: make test's, not test-fast's
RECORDED = Path(__file__).resolve().parents[2] / "docs" / "results" / "vision-matrix.json"
COLUMNS = ("alone", "amid text", "amid image", "two images", "prefix cache", "checkpoint")


def verdict(seen, want: list[list[int]]) -> str:
    return "exact" if [s.tokens for s in seen] == want else "DIFFERS from generate()"


def vision_row(name: str, tmp_path) -> dict[str, str]:
    vlm, processor = build(name)
    tok = processor.tokenizer
    lm = LoadedModel(model=text_model(vlm), tokenizer=tok, name=name, max_context=512, eos_ids=(tok.eos_token_id,),
                     vision=VisionEncoder(vlm, processor, torch.float32))
    # each check's prompt and images are test_vision.py's: a random model's answer can end at its EOS early
    prompt, red, wide, blue = chat(tok, "what is in this picture?"), picture(1), picture(2, (60, 30)), picture(2)
    want_red, want_wide = reference(vlm, processor, prompt, [red]), reference(vlm, processor, prompt, [wide])
    assert want_red != want_wide  # the image reaches the answer: a check that could not tell proves nothing
    text = [(tok.encode(t), GREEDY) for t in ("hello there", "a longer text-only prompt", "x")]
    image_red = request(lm, prompt, [red], ["red"])
    row = {"alone": verdict(run_engine(lm, [image_red], prefix_cache_bytes=0)[0], [want_red]),
           "amid text": verdict(run_engine(lm, [*text[:2], image_red, text[2]], together=True,
                                           prefix_cache_bytes=0)[0][2:3], [want_red]),
           "amid image": verdict(run_engine(lm, [image_red, request(lm, prompt, [wide], ["wide"])], together=True,
                                            prefix_cache_bytes=0)[0], [want_red, want_wide])}

    two = chat(tok, "compare them", images=2)
    ids, both = lm.vision.encode(two, [red, blue], ["red", "blue"], max_image_tokens=10_000)
    row["two images"] = verdict(run_engine(lm, [(ids, GREEDY, both)], prefix_cache_bytes=0)[0],
                                [reference(vlm, processor, two, [red, blue])])
    for digests in (["green", "blue"], ["red", "green"]):
        images = [dict(red=red, green=picture(3), blue=blue)[d] for d in digests]
        other_ids, changed_one = lm.vision.encode(two, images, digests, max_image_tokens=10_000)
        assert other_ids == ids  # same sizes, same placeholders: only the keys can tell the prompts apart
        changed = int(both.positions[(both.embeds != changed_one.embeds).any(-1)][0])  # its first placeholder
        keys = zip(both.keys(ids), changed_one.keys(ids))
        differs = next((i for i, (a, b) in enumerate(keys) if a != b), None)
        # the keys change at the changed image's first placeholder, or before (several runs keyed together)
        assert differs is not None and both.positions[0] <= differs <= changed, "the keys must tell images apart"

    longer = chat(tok, "describe it " * 6)
    cached_red = request(lm, longer, [red], ["red"])
    positions = cached_red[2].positions
    (first, other, again), engine = run_engine(lm, [cached_red, request(lm, longer, [blue], ["blue"]), cached_red],
                                               prefix_cache_bytes=2**24)
    if engine.prefix_cache is None:  # sliding-window layers (Gemma 3): no prefix cache, as for text models
        assert not keeps_all_keys(lm.model.config)
        row["prefix cache"] = "off: sliding window"
    elif other.cached_tokens > positions[0]:
        row["prefix cache"] = "WRONG: another image's blocks reused"
    elif again.cached_tokens <= positions[-1]:
        row["prefix cache"] = "not reused"
    else:
        row["prefix cache"] = verdict([other, again], [reference(vlm, processor, longer, [blue]), first.tokens])
        row["prefix cache"] += ", keyed by pixels" if row["prefix cache"] == "exact" else ""

    save_checkpoint(vlm, processor, tmp_path / "model")
    loaded = load_model(str(tmp_path / "model"), device="cpu", dtype="float32", prepack="false", quant="none",
                        cache_dir=tmp_path / "cache")
    assert isinstance(loaded.vision, VisionEncoder)
    assert type(loaded.vision.processor).__name__ == type(processor).__name__
    prompt = chat(loaded.tokenizer, "what is in this picture?", images=2)
    expected, got = (p(text=[prompt], images=[[red, wide]], return_tensors="pt")
                     for p in (processor, loaded.vision.processor))
    if sorted(got) != sorted(expected) or not all(torch.equal(got[k], expected[k]) for k in expected):
        row["checkpoint"] = "loads; its processor prepares other inputs"
    else:
        seen, _ = run_engine(loaded, [request(loaded, prompt, [red, wide], ["a", "b"])], prefix_cache_bytes=0)
        row["checkpoint"] = "loads, " + verdict(seen, [reference(vlm, processor, prompt, [red, wide])])
    return row


@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_family_gives_generates_tokens_on_every_check_as_recorded(name, tmp_path):
    row = vision_row(name, tmp_path)
    assert list(row) == list(COLUMNS)
    assert all(cell.startswith(("exact", "loads, exact", "off: ")) for cell in row.values()), f"{name}: {row}"
    check(name, row)


@pytest.mark.parametrize("model_type", list(UNSERVED))
def test_each_refused_family_is_recorded_with_the_reason_it_is_refused(model_type):
    import transformers as tf

    why = vision_problem(tf.AutoConfig.for_model(model_type), "none", 1)
    assert why is not None and UNSERVED[model_type] in why
    check(model_type, f"refused: {UNSERVED[model_type]}")


def test_the_record_holds_every_family_and_no_other():
    assert list(json.loads(RECORDED.read_text())["families"]) == [*FAMILIES, *UNSERVED]


def check(family: str, row: dict[str, str] | str) -> None:
    """The row equals the recorded one; with RECORD_VISION_MATRIX set, it is recorded first."""
    if os.environ.get("RECORD_VISION_MATRIX"):
        record_row(family, row)
    assert json.loads(RECORDED.read_text())["families"].get(family) == row, (
        f"{family}: the vision matrix changed; record it (RECORD_VISION_MATRIX=1) and run `make docs-figures`")


def record_row(family: str, row: dict[str, str] | str) -> None:
    """Into docs/results/vision-matrix.json, in the results' envelope (where, when, on which versions)."""
    from benchmarks import record

    recorded = json.loads(RECORDED.read_text()) if RECORDED.exists() else {"families": {}}
    families = recorded["families"] | {family: row}
    RECORDED.write_text(json.dumps({
        "schema": record.SCHEMA, "bench": "vision",
        "source": "RECORD_VISION_MATRIX=1 pytest tests/fast/test_vision_matrix.py",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": record.machine(), "versions": record.versions(),
        "settings": {"dtype": "float32", "max_tokens": GREEDY.max_tokens},
        "families": {f: families[f] for f in [*FAMILIES, *UNSERVED] if f in families}},
        indent=1, ensure_ascii=False) + "\n")
