"""docs/models.md's supported-models table: one row per family, its serving paths as the architecture matrix
recorded them (docs/results/model-matrix.json, written by tests/fast/test_model_matrix.py), and what this module
knows of the family itself: a published checkpoint, its parameter count, and its tool-call and reasoning formats.

`FAMILIES` is the mapping the table reads. The parser names are those TOOL_CALL_PARSER and REASONING_PARSER take
(app/openai/tools/, app/openai/reasoning); "none": the family's templates have no such format. Memory is computed,
not measured: the published parameter count x bytes per weight (2 in bf16, 1 in int8, 0.5 in int4), weights only;
the KV cache and activations come on top.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    name: str  # as the table shows it
    checkpoint: str  # a published checkpoint of the family (hub id), served with MODEL=<it>
    params_b: float  # its published parameter count, in billions (the model card's)
    tools: str  # TOOL_CALL_PARSER for it
    reasoning: str  # REASONING_PARSER for it, or "none"
    expect: str  # what to expect when serving it, in a sentence


# keyed by transformers' model_type, as the matrix records it
FAMILIES = {
    "llama": Family("Llama 3.x", "meta-llama/Llama-3.1-8B-Instruct", 8.03, "llama3_json", "none",
                    "Llama 3.2 1B/3B write pythonic calls (`TOOL_CALL_PARSER=pythonic`)."),
    "mistral": Family("Mistral", "mistralai/Mistral-7B-Instruct-v0.3", 7.25, "mistral", "magistral",
                      "No sliding window, as v0.3 and Mistral Small 3 set it (a config with one serves as Gemma 3 "
                      "does). Magistral's thinking is the `magistral` parser."),
    "qwen2": Family("Qwen2 / Qwen2.5", "Qwen/Qwen2.5-7B-Instruct", 7.62, "hermes", "none",
                    "The embedded default is a Qwen2.5."),
    "qwen3": Family("Qwen3", "Qwen/Qwen3-8B", 8.19, "hermes", "qwen3",
                    "`enable_thinking` and the thinking budget apply."),
    "qwen3_moe": Family("Qwen3-MoE", "Qwen/Qwen3-30B-A3B", 30.5, "hermes", "qwen3",
                        "QUANT leaves the experts (most of the weights) unquantized. Qwen3-Coder writes XML calls "
                        "(`TOOL_CALL_PARSER=qwen3_coder`)."),
    "gemma2": Family("Gemma 2", "google/gemma-2-9b-it", 9.24, "none", "none",
                     "Its attention soft-capping runs on its own eager attention function, per request in a "
                     "packed pass (no compiled step); sliding-window layers."),
    "gemma3_text": Family("Gemma 3 (text)", "google/gemma-3-1b-it", 1.0, "pythonic", "none",
                          "Sliding-window layers. The 4B and larger checkpoints are image-text models "
                          "([vision](#vision-models))."),
    "phi3": Family("Phi-3 / Phi-4-mini", "microsoft/Phi-4-mini-instruct", 3.84, "phi4_mini", "none", "Partial rotary."),
    "granite": Family("Granite 3.x", "ibm-granite/granite-3.3-8b-instruct", 8.17, "granite", "granite",
                      "Its logit and residual scales are applied as its own forward does."),
    "olmo2": Family("OLMo 2", "allenai/OLMo-2-1124-7B-Instruct", 7.30, "none", "none", "QK norms."),
    "cohere2": Family("Cohere Command R7B", "CohereLabs/c4ai-command-r7b-12-2024", 8.03, "none", "none",
                      "Sliding-window layers."),
    "mixtral": Family("Mixtral", "mistralai/Mixtral-8x7B-Instruct-v0.1", 46.7, "mistral", "none",
                      "QUANT leaves the experts (most of the weights) unquantized."),
    "deepseek_v3": Family("DeepSeek-V3 / R1 (MLA)", "deepseek-ai/DeepSeek-V3", 671, "deepseek_v3", "deepseek_r1",
                          "The cache and the compiled step's pool hold MLA's latent (576 values a token and layer), "
                          "not per-head keys. R1's thinking is the `deepseek_r1` parser."),
    "gpt_oss": Family("gpt-oss", "openai/gpt-oss-20b", 20.9, "harmony", "harmony",
                      "Its attention sinks run on its own eager attention function, per request in a packed pass "
                      "(no compiled step); sliding-window layers. The published weights are MXFP4, which "
                      "transformers dequantizes where its MXFP4 kernels do not run: not tested here."),
}

BYTES_PER_WEIGHT = {"bf16": 2, "int8": 1, "int4": 0.5}
COLUMNS = ("solo", "batched", "prefix_cache", "speculation", "compiled", "int8", "int4", "lora")


def memory(family: Family, quantized_experts: bool) -> str:
    """Weights only, computed: params x bytes per weight. Where QUANT leaves the experts, only bf16 applies."""
    kinds = BYTES_PER_WEIGHT if quantized_experts else {"bf16": 2}
    return ", ".join(f"{kind} {family.params_b * size:,.0f} GB" if family.params_b * size >= 10 else
                     f"{kind} {family.params_b * size:.1f} GB" for kind, size in kinds.items())


def models_table(runs: list[tuple[str, dict]]) -> str:
    (name, run), = runs
    matrix = run["families"]
    missing = set(matrix) ^ set(FAMILIES)
    if missing:
        raise ValueError(f"{name} and benchmarks/models_table.py's FAMILIES disagree on {sorted(missing)}")
    rows = ["| family (`model_type`) | solo | batched | prefix cache | speculation | compiled | int8 | int4 | LoRA "
            "| tools | reasoning | weights in memory (computed) |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for model_type, row in matrix.items():
        family = FAMILIES[model_type]
        quantized_experts = "experts not quantized" not in row["int8"]
        cells = [row[column].replace(", experts not quantized", " (experts not)") for column in COLUMNS]
        rows.append(f"| {family.name} (`{model_type}`) | " + " | ".join(cells) + " | "
                    f"`{family.tools}` | `{family.reasoning}` | {memory(family, quantized_experts)} |")
    return "\n".join(rows + ["", _source("Paths as", name, run, "tests/fast/test_model_matrix.py")])


def _source(what: str, name: str, run: dict, test: str) -> str:
    """The footnote under a matrix's table: the record it came from, and where and with what it ran."""
    return (f"<sub>{what} [`{name}`](results/{name}) records them: {test}, tiny random models in fp32; "
            f"{run['machine']['cpu']}, {run['date']}, transformers {run['versions'].get('transformers', '?')}.</sub>")


def exactness(row: dict[str, str]) -> str:
    """What the matrix says of a family's exact paths, in words."""
    exact = [c for c in COLUMNS[:5] if row[c].startswith("exact")]
    offs = [f"{c.replace('_', ' ')} off ({row[c].removeprefix('off: ')})" for c in COLUMNS[:5]
            if row[c].startswith("off")]
    if not offs and len(exact) == 5:
        return "exact on every path"
    return "exact on every path it takes; " + ", ".join(offs)


def expectations_list(runs: list[tuple[str, dict]]) -> str:
    """One line per family: its published checkpoint, what the matrix says, and what else to expect."""
    (_, run), = runs
    return "\n".join(f"- **{FAMILIES[t].name}** (`MODEL={FAMILIES[t].checkpoint}`, {FAMILIES[t].params_b:g}B "
                     f"parameters): {exactness(row)}. {FAMILIES[t].expect}" for t, row in run["families"].items())


# keyed by model_type, as tests/fast/test_vision_matrix.py records them (in the record's order): name, checkpoint
VISION = {"llava": ("LLaVA 1.5", "llava-hf/llava-1.5-7b-hf"), "gemma3": ("Gemma 3", "google/gemma-3-4b-it"),
          "gemma3n": ("Gemma 3n", "google/gemma-3n-E4B-it"), "internvl": ("InternVL", "OpenGVLab/InternVL3-8B-hf"),
          "qwen2_vl": ("Qwen2-VL", "Qwen/Qwen2-VL-7B-Instruct"), "qwen3_vl": ("Qwen3-VL", "Qwen/Qwen3-VL-8B-Instruct"),
          "llava_next": ("LLaVA-NeXT", "llava-hf/llava-v1.6-mistral-7b-hf"),
          "llava_onevision": ("LLaVA-OneVision", "llava-hf/llava-onevision-qwen2-7b-ov-hf"),
          "mistral3": ("Mistral 3", "mistralai/Mistral-Small-3.1-24B-Instruct-2503"),
          "idefics3": ("Idefics3", "HuggingFaceM4/Idefics3-8B-Llama3"),
          "qwen2_5_vl": ("Qwen2.5-VL", "Qwen/Qwen2.5-VL-7B-Instruct"),
          "qwen3_vl_moe": ("Qwen3-VL-MoE", "Qwen/Qwen3-VL-30B-A3B-Instruct")}


def vision_table(runs: list[tuple[str, dict]]) -> str:
    """One row per vision family: each check's verdict (its columns in the record's order), or why it is refused."""
    (name, run), = runs
    if unknown := sorted(set(run["families"]) - set(VISION)):
        raise ValueError(f"{name} records {unknown}, which benchmarks/models_table.py's VISION does not name")
    rows = ["| family (`model_type`) | published checkpoint | alone | amid text | amid image | two images "
            "| prefix cache | checkpoint dir |", "| --- " * 8 + "|"]
    for t, row in run["families"].items():
        cells = [row] + [""] * 5 if isinstance(row, str) else list(row.values())
        rows.append(f"| {VISION[t][0]} (`{t}`) | `{VISION[t][1]}` | " + " | ".join(cells) + " |")
    return "\n".join(rows + ["", _source("As", name, run, "tests/fast/test_vision_matrix.py")])


TABLES = {"models": models_table, "model-expectations": expectations_list, "vision": vision_table}
