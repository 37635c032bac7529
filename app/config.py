"""Settings for the server and the CLI, read from env vars (no prefix) and overridden by CLI flags.

Everything an operator can tune lives here, so docs/configuration.md (generated from this class), the Docker image's env vars and
`python -m app serve --help` all describe the same fields.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from app.auth import split_keys

DEFAULT_MODEL = "qwen2.5-coder-0.5b-instruct"
PrepackMode = Literal["auto", "true", "false"]


def prepack_mode(value: object) -> object:
    """PREPACK=auto|true|false; also the booleans of `--prepack/--no-prepack` and env spellings such as 1/0/on/off."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        word = value.strip().lower()
        return {"1": "true", "yes": "true", "on": "true", "0": "false", "no": "false", "off": "false"}.get(word, word)
    return value


def parse_lora_modules(value: str) -> dict[str, str]:
    """`name=path,name=path` (LORA_MODULES, vLLM's `--lora-modules` spelling) -> {name: path}."""
    modules: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in value.split(","))):
        name, eq, path = item.partition("=")
        if not eq or not name.strip() or not path.strip():
            raise ValueError(f"{item!r} is not name=path")
        if name.strip() in modules:
            raise ValueError(f"adapter name {name.strip()!r} is given twice")
        modules[name.strip()] = path.strip()
    return modules


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_file=None, extra="ignore", protected_namespaces=())

    model: str = Field(DEFAULT_MODEL, description="embedded model name, local HF dir, .gguf file, or hub id")
    served_model_name: str | None = Field(None, description="id clients send as `model` (default: derived from MODEL)")
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    prepack: PrepackMode = Field("auto", description="CPU: reorder linear weights once for oneDNN; bf16 in place "
                                 "(bit-identical, faster), fp32 as a copy for batched rows (one row stays exact; the "
                                 "linears' size again in RAM); auto: where it can, true: fail at start where it cannot. "
                                 "With BATCH_INVARIANT on, fp32's copy takes every row count of the engine's passes; "
                                 "without it (false, or too little RAM) they take a slower way the start checks "
                                 "(on an AVX2 EPYC: MKL in tiles of 8 rows, ~2.6x at one row)")
    quant: Literal["auto", "none", "int8", "int4"] = Field("auto", description="auto: a .gguf file keeps each "
                                                   "tensor's own codes (its 4-bit blocks as int4, 5- to 8-bit ones "
                                                   "as 8-bit groups, none rounded again), anything else none; "
                                                   "none: unquantized; int8: every linear reads int8 weights "
                                                   "(faster, not exact; quality measured by `bench quality`); int4: "
                                                   "the decoder's linears read 4 bits in groups of 32, the lm_head "
                                                   "int8. Either holds the embedding table as int8 rows and nothing "
                                                   "of the loaded floats; a tied lm_head multiplies those rows, "
                                                   "except under int8 on a CPU without native bf16. With DTYPE=auto, "
                                                   "int8 runs in fp32 (fbgemm's int8 kernels), int4 in bf16 where "
                                                   "the CPU has native bf16, else fp32")
    int4_wide_copy: bool = Field(False, description="QUANT=int4 on a CPU with native bf16 (AVX512_BF16, AMX): "
                                 "calls of over 4 rows (prefill chunks, many streams) multiply a bf16 copy of the "
                                 "4-bit weights, faster there but 2 bytes a weight more memory, more than bf16's "
                                 "own total (the start log gives its bytes); off: every call on the int4 kernel. "
                                 "Ignored with BATCH_INVARIANT on")
    int4_kernel: Literal["auto", "vnni", "avx2", "reference", "aten"] = Field("auto", description="QUANT=int4's "
                                 "kernel: auto: ours (int8 activations times the 4-bit weights in integers, built "
                                 "with the C++ compiler at the first int4 load) on AVX512-VNNI where the CPU has "
                                 "it, else AVX2; vnni, avx2, reference (plain C++, slow): that path of ours; aten: "
                                 "torch's int4 kernel (bf16 activations), which is also what runs where ours "
                                 "cannot be built or the CPU has neither (the start log says why)")
    decode_attention: Literal["auto", "avx512", "avx2", "reference", "torch"] = Field("auto", description="the "
                                 "CPU's attention for decode rows and speculative verify passes (outside the fp32 "
                                 "oracle, which keeps SDPA): auto: our kernel (built with the C++ compiler by "
                                 "`make setup`, else at the first load that needs it), its AVX-512 path where the "
                                 "CPU has it, else AVX2; avx512, avx2, reference (plain C++, slow): that path; "
                                 "torch: torch's ops over an fp32 copy of the cache, which is also what runs where "
                                 "ours cannot be built (the start log says why)")
    batch_invariant: Literal["auto", "on", "off"] = Field("auto", description="on: a request's tokens and "
                                                          "logprobs do not depend on what else is running (each op "
                                                          "computes a row the same way at any batch, LoRA adapters' "
                                                          "products included; docs/walkthrough.md); refused at start "
                                                          "for a model the engine runs one request per pass; auto: "
                                                          "on for a CPU in fp32 without QUANT, with PREPACK's fp32 "
                                                          "copies (measured no slower), off elsewhere and for such a "
                                                          "model (the start log, /ready and /v1/models say why; the "
                                                          "performance page gives its cost)")
    api_key: str | None = Field(None, description="if set, requests need `Authorization: Bearer <key>`; several "
                                "keys, comma-separated, are several tenants")
    prefix_cache_per_key: bool = Field(True, description="each API key reuses only prefix-cache entries made under "
                                       "the same key, so tenants cannot probe each other's prompts through "
                                       "`cached_tokens` (off: the keys share the cache)")
    metrics_require_key: bool = Field(False, description="/metrics needs an API key too (off: open to scrapers; "
                                      "it shows server-wide counts, docs/limits.md says which); needs API_KEY "
                                      "(refused at start without it)")
    max_active: int = Field(8, ge=1, description="sequences decoded at once")
    max_queue: int = Field(64, ge=0, description="requests waiting beyond max_active before 429")
    prefill_tokens_per_step: int | None = Field(None, ge=16, description="prompt tokens prefilled per engine step "
                                                "(default: 128 on CPU, 2048 on GPU)")
    prefix_cache_bytes: int = Field(512 * 2**20, ge=0, description="KV of earlier prompts kept for reuse, in bytes; "
                                    "suffixes as KV_CACHE_BYTES (0 turns automatic prefix caching off)")
    speculative: Literal["ngram", "off"] = Field("ngram", description="n-gram speculative decoding: draft tokens "
                                                 "from the request's own prompt and output, verify them in one pass")
    tensor_parallel: int = Field(1, ge=1, description="split the model over this many GPUs (or CPU processes) with "
                                 "transformers' tensor-parallel plan; launch with `torchrun --nproc-per-node N`")
    decode_step: Literal["eager", "compiled"] = Field("eager", description="experimental until it has run on a "
                                                      "GPU (on a CPU it measured slower than eager). compiled: steps "
                                                      "where every request decodes one token run a step of fixed "
                                                      "shapes over a KV pool allocated at start (charged to "
                                                      "KV_CACHE_BYTES, at most half of it), compiled per batch "
                                                      "bucket at start (CUDA: captured as graphs); not bit-identical "
                                                      "to eager; steps that verify speculative drafts stay eager; on "
                                                      "a CPU in bf16 it needs PREPACK=false")
    lora_modules: Annotated[dict[str, str], NoDecode] = Field(
        default_factory=dict, description="LoRA adapters loaded at start, `name=path,name=path` (peft's "
        "safetensors format, vLLM's `--lora-modules` spelling); a request's `model` names one, and requests of "
        "several adapters and the base share passes (docs/adapters.md)")
    max_loras: int = Field(4, ge=1, description="LoRA adapters loaded at once (loading one more is a 400 until one "
                           "is unloaded)")
    max_loras_per_key: int | None = Field(None, ge=1, description="adapters one API key may hold loaded at "
                                          "runtime, within MAX_LORAS (400 past it). Default: half the slots "
                                          "LORA_MODULES leaves (MAX_LORAS less their count), at least 1, so that "
                                          "one key cannot take every slot; all of them when API_KEY is one key")
    max_lora_rank: int = Field(16, ge=1, description="highest LoRA rank an adapter may have (400 past it)")
    lora_runtime_loading: bool = Field(False, description="serve POST /v1/load_lora_adapter and "
                                       "/v1/unload_lora_adapter; needs API_KEY and LORA_ADAPTER_ROOT (refused at "
                                       "start without them); off: both answer 404. An adapter loaded at runtime "
                                       "belongs to the key that loaded it: only that key sees, uses, replaces or "
                                       "unloads it, and other keys may load their own under the same name")
    lora_adapter_root: Path | None = Field(None, description="the one directory runtime loading reads adapters "
                                           "from: a `lora_path` is taken relative to it, resolved (symlinks and "
                                           "`..` followed) and refused unless it lands inside it (LORA_MODULES "
                                           "may point anywhere)")
    max_model_len: int | None = Field(None, ge=16, description="context window (default: the model's)")
    kv_cache_bytes: int | None = Field(None, ge=1, description="KV cache memory budget in bytes; suffixes K, M, G, "
                                       "Ki, Mi, Gi (default: GPU free memory after loading less 10% of the GPU; "
                                       "CPU: half the RAM available after loading)")
    kv_cache_dtype: Literal["auto", "int8"] = Field("auto", description="auto: keys and values cached in the "
                                                   "model's dtype; int8: a byte a value and an fp16 scale per token, "
                                                   "head and group of channels (4 for keys, 32 for values; values "
                                                   "as llama.cpp's q8_0), 0.64x bf16's bytes, so the KV budget holds "
                                                   "about 1.56x the tokens; rounds what attention reads (perplexity "
                                                   "measured by `bench perplexity`). Not with "
                                                   "DECODE_STEP=compiled, tensor parallelism or a latent-attention "
                                                   "(MLA) model")
    default_max_tokens: int = Field(4096, ge=1, description="max_tokens of a request that sets none (at most the "
                                    "context left)")
    max_request_bytes: int = Field(1_048_576, ge=1024, description="largest accepted request body")
    max_vision_request_bytes: int = Field(32 * 2**20, ge=1024, description="largest request body when the model "
                                          "takes images, whose data URLs travel in the body (a text model keeps "
                                          "MAX_REQUEST_BYTES)")
    max_json_depth: int = Field(128, ge=8, description="deepest nesting of arrays and objects in a request body "
                                "(400 past it, before the body is parsed)")
    max_messages: int = Field(2048, ge=1, description="messages in a request (Responses: `input` items); 400 past "
                              "it, before validation")
    max_content_blocks: int = Field(8192, ge=1, description="content blocks and tool calls in all of a request's "
                                    "messages together (400 past it, before validation)")
    max_tools: int = Field(128, ge=1, description="tools in a request (400 past it, before validation)")
    max_images_per_request: int = Field(8, ge=0, description="images in one request, all messages together (400 "
                                        "past it; 0: images refused)")
    max_image_bytes: int = Field(10 * 2**20, ge=1024, description="encoded bytes of one image, after base64 "
                                 "decoding or as fetched (400 past it, checked before decoding); suffixes as "
                                 "KV_CACHE_BYTES. A data URL also counts toward MAX_VISION_REQUEST_BYTES")
    max_image_pixels: int = Field(16 * 2**20, ge=1, le=2**27, description="width x height of one image, read from "
                                  "its header before any pixel is decoded (400 past it); at most 2^27, below "
                                  "Pillow's own decompression-bomb guard")
    max_image_tokens: int = Field(16384, ge=1, description="tokens the images of one request become, all together "
                                  "(400 past it, before the model runs)")
    image_url_hosts: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="hosts (comma-separated, exact names) whose http(s) image URLs the "
        "server fetches, redirects included; empty: remote image URLs are refused and only data URLs are read "
        "(a server that fetches any URL is a way into its own network)")
    image_url_timeout_s: float = Field(10.0, gt=0, description="longest one image fetch may take, redirects and "
                                       "body included (400 past it)")
    tool_call_parser: Literal["auto", "hermes", "json", "llama3_json", "pythonic", "mistral", "deepseek_v3",
                              "granite", "phi4_mini", "qwen3_coder", "harmony"] = Field(
        "auto", description="how tool calls are read from the model's text (docs/tools-and-structured-outputs.md); "
        "auto: from the chat template and the tokenizer's special tokens (the start log says which); a name forces "
        "that format")
    max_prompt_logprob_entries: int = Field(1_000_000, ge=1, description="prompt logprob entries one request may "
                                            "return: prompt tokens x (alternatives + 1) x choices, for `echo` with "
                                            "`logprobs` or `prompt_logprobs` (400 past it, before anything runs)")
    max_preparing: int = Field(16, ge=1, description="requests being parsed, validated, templated or tokenized at "
                               "once, queued or running (429 past it)")
    prepare_workers: int = Field(2, ge=1, description="threads that parse, validate, template and tokenize "
                                 "requests, apart from the event loop")
    grammar_max_depth: int = Field(32, ge=1, description="deepest nesting of subschemas in a response_format or "
                                   "tool schema (400 past it)")
    grammar_max_repeat: int = Field(1000, ge=1, description="largest repetition bound in a schema's pattern "
                                    "(nested bounds multiplied, sequential ones added) or minItems/maxItems (400 "
                                    "past it)")
    grammar_max_total_repeat: int = Field(4000, ge=1, description="repetition bounds of every pattern and "
                                          "minItems/maxItems of a request's schemas, added up (400 past it)")
    grammar_max_enum_values: int = Field(1000, ge=1, description="enum values in a request's schemas, added up "
                                         "(400 past it)")
    grammar_max_literal_bytes: int = Field(32768, ge=1, description="bytes of the enum and const values of a "
                                           "request's schemas, as JSON (400 past it)")
    grammar_compile_timeout_s: float = Field(10.0, gt=0, description="a grammar compile running longer is stopped "
                                             "(400)")
    grammar_compile_workers: int = Field(1, ge=1, description="processes compiling grammars, apart from "
                                         "tokenization and generation")
    grammar_compile_queue: int = Field(8, ge=0, description="grammar compiles waiting for a worker (429 past it)")
    grammar_compile_per_client: int = Field(2, ge=1, description="grammar compiles one client may have running or "
                                            "waiting (429 past it); clients are served in turn")
    grammar_client_header: str | None = Field(None, description="request header that names the client for "
                                              "GRAMMAR_COMPILE_PER_CLIENT, set by a trusted proxy in front "
                                              "(default: the peer address, and the API key presented)")
    grammar_compile_memory_bytes: int = Field(2**30, ge=2**28, description="memory a grammar compile may add to "
                                              "its worker process; suffixes as KV_CACHE_BYTES (400 past it)")
    cors_origins: Annotated[list[str], NoDecode] = Field(default_factory=list)
    shutdown_grace_s: float = Field(30.0, ge=0, description="how long in-flight requests may run after SIGTERM")
    sse_send_timeout_s: float = Field(30.0, gt=0, description="a stream whose client accepts no event or ping for "
                                      "this long (it stopped reading) is ended and its generation cancelled")
    queue_timeout_s: float | None = Field(None, gt=0, description="longest a request may wait for a decode slot; "
                                          "past it, a 503 that says when to retry, and it never starts (unset: no limit)")
    request_timeout_s: float | None = Field(None, gt=0, description="longest a whole request may run, from arrival; "
                                            "past it, generation ends at that step with finish_reason `timeout` "
                                            "(unset: no limit). A request's own timeout header can only shorten "
                                            "it (docs/operations.md)")
    health_generate_timeout_s: float = Field(10.0, gt=0, description="/health/generate answers 503 when the "
                                             "engine has had work but completed no step for this long, or when "
                                             "idle, cannot generate one token within it")
    batch_dir: Path | None = Field(None, description="where OpenAI's Files and Batches API keeps its SQLite "
                                   "database and file bodies (one server per directory); unset: /v1/files and "
                                   "/v1/batches answer 404 (docs/batch.md)")
    batch_max_file_bytes: int = Field(100 * 2**20, ge=1024, description="largest file POST /v1/files accepts "
                                      "(413 past it): the one body allowed past MAX_REQUEST_BYTES, and only with "
                                      "BATCH_DIR set and a valid key; suffixes as KV_CACHE_BYTES")
    batch_max_lines: int = Field(50_000, ge=1, description="requests in one batch input file (400 past it)")
    batch_max_in_progress: int = Field(8, ge=1, description="batches one API key may have unfinished at once "
                                       "(429 past it)")
    batch_max_files_per_key: int = Field(1000, ge=1, description="files one API key may keep in BATCH_DIR, "
                                         "batch output and error files included (400 `files_quota_exceeded` "
                                         "past it); without API_KEY, the whole server's")
    batch_max_stored_bytes_per_key: int = Field(10 * 2**30, ge=1024, description="bytes of files one API key may "
                                                "keep in BATCH_DIR, output files included (400 "
                                                "`bytes_quota_exceeded` past it, before the upload's body is read "
                                                "when its length says so); suffixes as KV_CACHE_BYTES")
    batch_max_result_rows_per_key: int = Field(500_000, ge=1, description="requests in one API key's retained "
                                               "batches, finished or not: each keeps a row in SQLite and a line "
                                               "of an output file until BATCH_RETENTION_S (a batch past it is a "
                                               "400 `result_rows_quota_exceeded`)")
    batch_retention_s: float = Field(30 * 86400, gt=0, description="files (of every purpose) and finished "
                                     "batches are deleted this long after they were created (checked at start "
                                     "and hourly)")
    batch_concurrency: int = Field(2, ge=1, description="batch lines in the engine at once (queued or running), "
                                   "across all batches; they run in the slots interactive requests leave free, "
                                   "plus BATCH_SLOTS")
    batch_slots: int = Field(1, ge=0, description="decode slots batch lines may hold even while interactive "
                             "requests wait: the share that keeps a batch moving under steady traffic (at most "
                             "MAX_ACTIVE - 1; 0: batch lines run only in idle slots, and steady traffic can stop "
                             "them)")
    priority_keys: str | None = Field(None, description="API keys (comma-separated) whose requests may send a "
                                      "`priority` below 0, ahead of other clients; `*`: every client. Unset: none "
                                      "may (a 403 naming this setting); any client may send 0 or more, to run later",
                                      repr=False)
    log_format: Literal["plain", "json"] = Field("plain", description="json: one JSON object per log line, with "
                                                 "the request id and the access line's fields")
    model_cache: Path = Field(Path.home() / ".cache" / "simple-serve", description="where embedded models are kept")
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    reasoning_parser: str = Field("auto", description="how answers are split into thinking and content: auto (from "
                                  "the chat template and special tokens; the start log says which), none (all "
                                  "content), or one of deepseek_r1, granite, harmony, magistral, qwen3 "
                                  "(docs/reasoning.md)")

    @field_validator("cors_origins", mode="before")
    @classmethod
    def _split_origins(cls, value: object) -> object:
        # Env vars are flat strings: CORS_ORIGINS="https://a.example,https://b.example".
        if isinstance(value, str):
            return [origin.strip() for origin in value.split(",") if origin.strip()]
        return value

    @field_validator("image_url_hosts", mode="before")
    @classmethod
    def _split_hosts(cls, value: object) -> object:
        # IMAGE_URL_HOSTS="images.example.com,cdn.example.com": host names as a URL's host part reads (lower case)
        hosts = [host.strip().lower() for host in value.split(",")] if isinstance(value, str) else value
        if isinstance(hosts, list):
            for host in filter(None, hosts):
                if not isinstance(host, str) or "/" in host or host.count(":") == 1:
                    raise ValueError(f"{host!r} is not a host name; IMAGE_URL_HOSTS takes names such as "
                                     "images.example.com, without scheme, path or port")
            return [host.strip("[]") for host in hosts if host]
        return value

    @field_validator("lora_modules", mode="before")
    @classmethod
    def _split_lora_modules(cls, value: object) -> object:
        # LORA_MODULES="sql=/adapters/sql,chat=/adapters/chat", as vLLM's --lora-modules
        return parse_lora_modules(value) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _lora_fits(self) -> Settings:
        if self.lora and self.tensor_parallel > 1:
            raise ValueError("LoRA adapters (LORA_MODULES, LORA_RUNTIME_LOADING) are not served with "
                             "TENSOR_PARALLEL > 1: the adapters' products are not sharded; use one or the other")
        if len(self.lora_modules) > self.max_loras:
            raise ValueError(f"LORA_MODULES names {len(self.lora_modules)} adapters, more than MAX_LORAS="
                             f"{self.max_loras}")
        return self

    @model_validator(mode="after")
    def _no_setting_without_what_it_needs(self) -> Settings:
        # A setting that cannot take effect is refused rather than ignored: METRICS_REQUIRE_KEY without a key
        # would leave /metrics open while the operator believes it closed.
        keyed = bool(split_keys(self.api_key))
        if self.metrics_require_key and not keyed:
            raise ValueError("METRICS_REQUIRE_KEY=true needs API_KEY: without a key there is nothing to require and "
                             "/metrics would stay open; set API_KEY, or METRICS_REQUIRE_KEY=false")
        if self.lora_runtime_loading and not keyed:
            raise ValueError("LORA_RUNTIME_LOADING=true needs API_KEY: without a key anyone could make the server "
                             "read adapters and unload everyone's; set API_KEY, or LORA_RUNTIME_LOADING=false")
        if self.lora_runtime_loading and self.lora_adapter_root is None:
            raise ValueError("LORA_RUNTIME_LOADING=true needs LORA_ADAPTER_ROOT, the one directory runtime loads "
                             "may read from; set it, or LORA_RUNTIME_LOADING=false")
        if self.lora_adapter_root is not None and not self.lora_runtime_loading:
            raise ValueError("LORA_ADAPTER_ROOT applies only with LORA_RUNTIME_LOADING=true; set both or neither")
        if self.kv_cache_dtype == "int8" and (self.decode_step == "compiled" or self.tensor_parallel > 1):
            raise ValueError("KV_CACHE_DTYPE=int8 is kept by each request's own cache, which DECODE_STEP=compiled's "
                             "pool and tensor parallelism's mirrored caches are not; set KV_CACHE_DTYPE=auto, or "
                             "DECODE_STEP=eager and TENSOR_PARALLEL=1")
        if self.batch_invariant == "on" and self.decode_step == "compiled":  # before minutes of loading
            raise ValueError("BATCH_INVARIANT=on rules out DECODE_STEP=compiled, which runs decode rows in shapes "
                             "padded to the batch; set DECODE_STEP=eager or BATCH_INVARIANT=off")
        return self

    @property
    def lora(self) -> bool:
        """The model's linears are made adaptable: adapters at start, or loading them at runtime."""
        return bool(self.lora_modules) or self.lora_runtime_loading

    @property
    def loras_per_key(self) -> int:
        """MAX_LORAS_PER_KEY, or its default: half the runtime slots, at least 1. Half, not a fixed count, so that
        it grows with MAX_LORAS and a key still gets most of an idle server; with one key there is no other tenant
        to leave room for, so it gets them all."""
        if self.max_loras_per_key is not None:
            return self.max_loras_per_key
        slots = self.max_loras - len(self.lora_modules)
        return slots if len(set(split_keys(self.api_key))) <= 1 else max(1, slots // 2)

    @field_validator("kv_cache_bytes", "prefix_cache_bytes", "grammar_compile_memory_bytes", "batch_max_file_bytes",
                     "batch_max_stored_bytes_per_key", "max_image_bytes", "max_vision_request_bytes", mode="before")
    @classmethod
    def _parse_bytes(cls, value: object) -> object:
        # KV_CACHE_BYTES=8GiB reads better than 8589934592.
        if isinstance(value, str):
            match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?)?B?\s*", value, flags=re.I)
            if match:
                number, unit = match.groups()
                scale = 1 if unit is None else (1024 if unit.lower().endswith("i") else 1000) ** (
                    "KMGT".index(unit[0].upper()) + 1)
                return int(float(number) * scale)
        return value

    @field_validator("prepack", mode="before")
    @classmethod
    def _prepack_mode(cls, value: object) -> object:
        return prepack_mode(value)

    @field_validator("reasoning_parser")
    @classmethod
    def _known_reasoning_parser(cls, value: str) -> str:
        from app.openai.reasoning import check_parser_name  # the names live with the parsers

        return check_parser_name(value)

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower_level(cls, value: object) -> object:
        return value.lower() if isinstance(value, str) else value

    @property
    def model_id(self) -> str:
        """The id the API reports and accepts: explicit, else the last path component of MODEL."""
        if self.served_model_name:
            return self.served_model_name
        return Path(self.model.rstrip("/")).name.removesuffix(".gguf") or self.model
