"""The catalogue of bad input (docs/troubleshooting.md), each run through the command line as a user runs it:
exit 1, one line naming the file, tensor or flag, no traceback, and no output (nor any of its temporary
siblings) left behind. Cases that tests/test_bad_input.py and tests/test_mcore_to_hf_bad_input.py cover are
not repeated here."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_runner import assert_nothing_left, assert_one_line_error, run_cli
from safetensors.torch import load_file, save_file
from test_mcore_to_hf_bad_input import checkpoint, private_checkpoint  # noqa: F401 (fixtures)
from torch.distributed.checkpoint import FileSystemReader

from mconvert.formats.safetensors import SAFETENSORS_HEADER_BYTES
from mconvert.json_files import JSON_FILE_BYTES
from mconvert.mcore.checkpoint import RELEASE, TRACKER_FILE

LAYER_WEIGHT = "model.layers.1.mlp.down_proj.weight"


@pytest.fixture
def hf(hf_model_factory, tmp_path):
    """A private copy of a tiny Qwen2.5 checkpoint (one model.safetensors), for a test to break."""
    copy = tmp_path / "hf"
    shutil.copytree(hf_model_factory("qwen2.5-7b-instruct"), copy)
    return copy


def to_mcore(hf, out, *flags, **run):
    return run_cli("hf-to-mcore", "--load-dir", hf, "--save-dir", out, *flags, **run)


def to_hf(checkpoint, out, *flags):
    return run_cli("mcore-to-hf", "--load-dir", checkpoint, "--save-dir", out, *flags)


def same_files(directory, other) -> bool:
    """The same files with the same bytes (an export's are its tensors, index and config, written alike each time)."""
    return {p.name: p.read_bytes() for p in directory.iterdir()} == {p.name: p.read_bytes() for p in other.iterdir()}


def refused(result, out, *names):
    err = assert_one_line_error(result, *names)
    assert_nothing_left(out)
    return err


def write_config(hf, **changes):
    config = json.loads((hf / "config.json").read_text())
    config.update(changes)
    for name in [name for name, value in changes.items() if value is None]:
        del config[name]
    (hf / "config.json").write_text(json.dumps(config))


def header_of(path):
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + length]), data[8 + length :]


def write_with_header(path, header, body):
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + body)


def split_into_shards(hf, names_in_second=(LAYER_WEIGHT,)):
    """model.safetensors as two shards and an index, the second holding `names_in_second`."""
    tensors = load_file(hf / "model.safetensors")
    (hf / "model.safetensors").unlink()
    second = {name: tensors.pop(name) for name in names_in_second}
    save_file(tensors, hf / "model-00001-of-00002.safetensors")
    save_file(second, hf / "model-00002-of-00002.safetensors")
    weight_map = {name: "model-00001-of-00002.safetensors" for name in tensors}
    weight_map.update({name: "model-00002-of-00002.safetensors" for name in second})
    (hf / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


# --- HF checkpoints -------------------------------------------------------------------------------------


def test_a_truncated_safetensors_header(hf, tmp_path):
    path = hf / "model.safetensors"
    path.write_bytes(path.read_bytes()[:100])  # cut inside the JSON header
    refused(to_mcore(hf, tmp_path / "out"), tmp_path / "out", path, "truncated (header of")


def test_a_file_too_short_to_be_safetensors(hf, tmp_path):
    (hf / "model.safetensors").write_bytes(b"\x01\x02")
    refused(to_mcore(hf, tmp_path / "out"), tmp_path / "out", "model.safetensors", "not a safetensors file")


def test_a_header_that_is_not_json(hf, tmp_path):
    path = hf / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:12] = b"\xff\xfe{["
    path.write_bytes(bytes(data))
    refused(to_mcore(hf, tmp_path / "out"), tmp_path / "out", path, "unreadable safetensors header")


def test_a_header_whose_offsets_lie(hf, tmp_path):
    path = hf / "model.safetensors"
    header, body = header_of(path)
    begin, end = header[LAYER_WEIGHT]["data_offsets"]
    header[LAYER_WEIGHT]["data_offsets"] = [begin, end - 4]
    write_with_header(path, header, body)
    refused(to_mcore(hf, tmp_path / "out"), tmp_path / "out", path, LAYER_WEIGHT, "data_offsets")


def test_a_malformed_header_entry(hf, tmp_path):
    path = hf / "model.safetensors"
    header, body = header_of(path)
    del header[LAYER_WEIGHT]["shape"]
    write_with_header(path, header, body)
    refused(to_mcore(hf, tmp_path / "out"), tmp_path / "out", path, LAYER_WEIGHT, "malformed header entry")


def test_a_header_that_is_no_object_of_tensors(hf, tmp_path):
    """Found by fuzzing a whole model's file (scripts/fuzz/fuzz_readers.py hf-sources): a header that is the JSON `0`
    (AttributeError)."""
    path = hf / "model.safetensors"
    path.write_bytes(struct.pack("<Q", 1) + b"0")
    refused(to_mcore(hf, tmp_path / "out"), tmp_path / "out", path, "a JSON int, not an object of tensors")


def test_offsets_that_are_not_integers(hf, tmp_path):
    path = hf / "model.safetensors"
    header, body = header_of(path)
    header[LAYER_WEIGHT]["data_offsets"] = ["0", "4"]
    write_with_header(path, header, body)
    refused(to_mcore(hf, tmp_path / "out"), tmp_path / "out", path, LAYER_WEIGHT, "malformed header entry")


def test_an_unexpected_dtype(hf, tmp_path):
    path = hf / "model.safetensors"
    header, body = header_of(path)
    header[LAYER_WEIGHT]["dtype"] = "C64"
    write_with_header(path, header, body)
    refused(to_mcore(hf, tmp_path / "out"), tmp_path / "out", path, LAYER_WEIGHT, "unsupported dtype C64")


def test_an_index_path_outside_the_model_directory(hf, tmp_path):
    split_into_shards(hf)
    outside = tmp_path / "elsewhere.safetensors"
    shutil.copy(hf / "model-00002-of-00002.safetensors", outside)
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    index["weight_map"][LAYER_WEIGHT] = "../elsewhere.safetensors"
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    refused(to_mcore(hf, tmp_path / "out"), tmp_path / "out", "model.safetensors.index.json", LAYER_WEIGHT, "../elsewhere.safetensors")


def test_an_index_that_is_not_json(hf, tmp_path):
    split_into_shards(hf)
    (hf / "model.safetensors.index.json").write_text('{"weight_map": {')
    refused(to_mcore(hf, tmp_path / "out"), tmp_path / "out", "model.safetensors.index.json", "not a safetensors index")


def test_an_index_naming_a_tensor_its_shard_lacks(hf, tmp_path):
    split_into_shards(hf)
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.0.mlp.gate_proj.weight"] = "model-00002-of-00002.safetensors"
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    refused(to_mcore(hf, tmp_path / "out"), tmp_path / "out", "model-00002-of-00002.safetensors", "model.layers.0.mlp.gate_proj.weight")


def test_duplicate_tensor_names_across_shards(hf, tmp_path):
    split_into_shards(hf)
    first = load_file(hf / "model-00001-of-00002.safetensors")
    first[LAYER_WEIGHT] = load_file(hf / "model-00002-of-00002.safetensors")[LAYER_WEIGHT]
    save_file(first, hf / "model-00001-of-00002.safetensors")
    refused(to_mcore(hf, tmp_path / "out"), tmp_path / "out", LAYER_WEIGHT, "is also in model-00001-of-00002.safetensors")


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_a_non_finite_weight(hf, tmp_path, value):
    tensors = load_file(hf / "model.safetensors")
    tensors[LAYER_WEIGHT][3, 5] = value
    save_file(tensors, hf / "model.safetensors")
    refused(to_mcore(hf, tmp_path / "out"), tmp_path / "out", LAYER_WEIGHT, "NaN or Inf", "--allow-nonfinite")
    allowed = to_mcore(hf, tmp_path / "out", "--allow-nonfinite")
    assert allowed.returncode == 0, allowed.stderr


def test_a_config_missing_a_field(hf, tmp_path):
    write_config(hf, num_attention_heads=None)
    refused(to_mcore(hf, tmp_path / "out"), tmp_path / "out", "config.json", "num_attention_heads")


def test_a_config_that_is_not_json(hf, tmp_path):
    (hf / "config.json").write_text("{'model_type': 'qwen2'}")
    refused(to_mcore(hf, tmp_path / "out"), tmp_path / "out", "config.json", "not valid JSON")


def test_a_config_nested_deeper_than_pythons_stack(hf, tmp_path):
    """200,000 brackets deep: json's decoder recurses once a level and runs out of stack (RecursionError)."""
    (hf / "config.json").write_text("[" * 200_000 + "]" * 200_000)
    refused(to_mcore(hf, tmp_path / "out"), tmp_path / "out", "config.json", "not valid JSON")


def test_an_index_nested_deeper_than_pythons_stack(hf, tmp_path):
    (hf / "model.safetensors.index.json").write_text('{"weight_map": ' + "[" * 200_000 + "]" * 200_000 + "}")
    refused(to_mcore(hf, tmp_path / "out"), tmp_path / "out", "model.safetensors.index.json")


@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json"])
def test_a_json_file_larger_than_any_real_one(hf, tmp_path, name):
    """Read whole, a JSON file is first held to 100 MB (the largest index on the hub is about 11 MB); the file here
    is sparse, so the test writes nothing of that size."""
    with open(hf / name, "ab") as f:
        f.truncate(JSON_FILE_BYTES + 1)
    refused(to_mcore(hf, tmp_path / "out"), tmp_path / "out", name, "more than any config or index holds")


def test_a_safetensors_header_over_the_formats_limit(hf, tmp_path):
    """A header length within the file but past the safetensors library's own limit (100 MB): refused before it is
    read (a sparse file)."""
    path = hf / "model.safetensors"
    with open(path, "r+b") as f:
        f.write(struct.pack("<Q", SAFETENSORS_HEADER_BYTES + 1))
        f.truncate(SAFETENSORS_HEADER_BYTES + 100)
    refused(to_mcore(hf, tmp_path / "out"), tmp_path / "out", path, "over the safetensors limit")


def test_a_config_field_of_the_wrong_type(hf, tmp_path):
    write_config(hf, num_hidden_layers="2")
    refused(to_mcore(hf, tmp_path / "out"), tmp_path / "out", "config.json", "'num_hidden_layers' is '2'")


def test_a_config_that_is_not_an_object(hf, tmp_path):
    (hf / "config.json").write_text("[]")
    refused(to_mcore(hf, tmp_path / "out"), tmp_path / "out", hf / "config.json", "not an object")


def test_weights_only_in_pickled_bin_files(hf, tmp_path):
    torch.save(load_file(hf / "model.safetensors"), hf / "pytorch_model.bin")
    (hf / "model.safetensors").unlink()
    refused(to_mcore(hf, tmp_path / "out"), tmp_path / "out", hf, "pytorch_model.bin", "save the model as safetensors")


def test_a_directory_without_config(hf, tmp_path):
    (hf / "config.json").unlink()
    refused(to_mcore(hf, tmp_path / "out"), tmp_path / "out", "--load-dir", "no config.json")


def test_a_model_that_needs_remote_code(hf, tmp_path):
    write_config(hf, model_type="mimo", auto_map={"AutoModelForCausalLM": "modeling_mimo.MiMoForCausalLM"})
    refused(to_mcore(hf, tmp_path / "out"), tmp_path / "out", "config.json", "mimo", "auto_map")


def _transformers_config(model_type: str) -> dict:
    """The config.json transformers 5.24 writes for its built-in `model_type`, with its defaults."""
    import transformers

    return transformers.AutoConfig.for_model(model_type).to_dict()


@pytest.mark.parametrize("config, names", [
    ("step-3.5-flash.json", ["model_type 'step3p5' (Step-3.5-Flash)", "megatron-core 0.19.2", "attention head counts per layer (64 and 96)",
                             "rope per layer", "SwiGLU clamps per layer", "transformers 5.24 has no causal-LM class"]),
    ("gemma-4-31b-it.json", ["model_type 'gemma4' (Gemma 4)", "megatron-core 0.19.2", "final logit softcapping",
                             "a head dimension per layer (256 and 512)", "keys reused as values (attention_k_eq_v)"]),
    ("deepseek_v4", ["model_type 'deepseek_v4' (DeepSeek-V4)", "megatron-core 0.19.2", "compressed attention", "hyper-connections (4 residual streams)"]),
    ("kimi_linear", ["model_type 'kimi_linear' (Kimi-Linear)", "megatron-core 0.19.2", "Kimi delta attention"]),
], ids=["step3p5", "gemma4", "deepseek_v4", "kimi_linear"])
def test_a_model_no_megatron_core_configuration_expresses_is_refused_from_its_config_alone(config, names, tmp_path):
    """A directory holding config.json and no weights: the refusal names what megatron-core lacks, before any tensor is
    looked for (Step-3.5-Flash and Gemma 4 as published, DeepSeek-V4 and Kimi-Linear as transformers writes them)."""
    hf = tmp_path / "hf"
    hf.mkdir()
    published = Path(__file__).parent / "fixtures" / "configs" / config
    (hf / "config.json").write_text(published.read_text() if published.exists() else json.dumps(_transformers_config(config)))
    refused(to_mcore(hf, tmp_path / "out"), tmp_path / "out", "config.json", *names)


def test_experts_that_expert_parallelism_cannot_divide(hf_model_factory, tmp_path):
    moe = hf_model_factory("qwen3-30b-a3b")  # 8 experts
    refused(to_mcore(moe, tmp_path / "out", "--ep", "3"), tmp_path / "out", "--ep 3")


# --- Where the output goes --------------------------------------------------------------------------------


@pytest.fixture
def mounted(tmp_path):
    """mount(options) -> a fresh tmpfs mounted with `options` (needs root; the test is skipped without)."""
    points = []

    def mount(options):
        point = tmp_path / f"mnt{len(points)}"
        point.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)], capture_output=True)
        if done.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
        points.append(point)
        return point

    yield mount
    for point in points:
        subprocess.run(["umount", str(point)], check=True)


def test_output_on_a_read_only_file_system(hf, mounted):
    read_only = mounted("ro,size=1m")
    out = read_only / "out"
    refused(to_mcore(hf, out), out, "--save-dir", "Read-only file system")


def test_output_under_a_file(hf, tmp_path):
    (tmp_path / "a-file").write_text("x")
    out = tmp_path / "a-file" / "out"
    assert_one_line_error(to_mcore(hf, out), "--save-dir", "cannot write there")
    assert (tmp_path / "a-file").read_text() == "x"


def test_disk_full_during_the_write(hf, mounted):
    small = mounted("size=256k")  # the model's weights are about 600 KB
    out = small / "out"
    refused(to_mcore(hf, out), out, "--save-dir", "No space left on device")
    assert not list(small.iterdir())  # what was written is removed, which frees the space again


def test_a_file_size_limit_during_the_write(hf, tmp_path):
    """Without a mount (not root): a file size limit (RLIMIT_FSIZE) stops the write as a full disk does."""
    import resource
    import signal

    def limit_file_size():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))

    out = tmp_path / "out"
    refused(to_mcore(hf, out, preexec_fn=limit_file_size), out, "--save-dir", "File too large")


# --- Megatron checkpoints -------------------------------------------------------------------------------


def test_a_missing_distcp_file(private_checkpoint, tmp_path):
    data = private_checkpoint / RELEASE / "__0_0.distcp"
    data.unlink()
    refused(to_hf(private_checkpoint, tmp_path / "out"), tmp_path / "out", data, "missing")


def test_a_truncated_distcp_file(private_checkpoint, tmp_path):
    data = private_checkpoint / RELEASE / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    refused(to_hf(private_checkpoint, tmp_path / "out"), tmp_path / "out", data)


def test_a_corrupt_metadata_file(private_checkpoint, tmp_path):
    metadata = private_checkpoint / RELEASE / ".metadata"
    metadata.write_bytes(metadata.read_bytes()[:200])
    refused(to_hf(private_checkpoint, tmp_path / "out"), tmp_path / "out", metadata, "unreadable DCP metadata")


def test_metadata_without_the_fields_of_dcp_metadata(private_checkpoint, tmp_path):
    metadata = private_checkpoint / RELEASE / ".metadata"
    stored = FileSystemReader(metadata.parent).read_metadata()
    del stored.storage_data  # where each chunk is: without it no tensor can be found
    metadata.write_bytes(pickle.dumps(stored))
    refused(to_hf(private_checkpoint, tmp_path / "out"), tmp_path / "out", metadata, "unreadable DCP metadata")


class _Marker:
    """Unpickling this runs `open(path, "w")`: what a malicious pickle does instead of holding data."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


def test_metadata_that_would_run_code(private_checkpoint, tmp_path):
    marker = tmp_path / "ran"
    metadata = private_checkpoint / RELEASE / ".metadata"
    metadata.write_bytes(pickle.dumps(_Marker(marker)))
    refused(to_hf(private_checkpoint, tmp_path / "out"), tmp_path / "out", metadata, "not allowed")
    assert not marker.exists()


@pytest.mark.parametrize("content", [b"PK\x03\x04 not really a zip", b""], ids=["corrupt", "empty"])
def test_a_corrupt_common_pt(private_checkpoint, tmp_path, content):
    common = private_checkpoint / RELEASE / "common.pt"
    common.write_bytes(content)
    refused(to_hf(private_checkpoint, tmp_path / "out"), tmp_path / "out", common, "not a torch.save file")


def test_a_tracker_holding_garbage(private_checkpoint, tmp_path):
    (private_checkpoint / TRACKER_FILE).write_text("latest\n")
    refused(to_hf(private_checkpoint, tmp_path / "out"), tmp_path / "out", TRACKER_FILE, "'latest'")


def legacy_checkpoint(directory, state):
    """A legacy `torch`-format checkpoint of one rank holding `state`."""
    rank_dir = directory / "iter_0000010" / "mp_rank_00"
    rank_dir.mkdir(parents=True)
    torch.save(state, rank_dir / "model_optim_rng.pt")
    (directory / TRACKER_FILE).write_text("10")
    return rank_dir / "model_optim_rng.pt"


@pytest.mark.parametrize("content", [b"\xff\xfe\xd0", b"9" * 5000], ids=["not-text", "5000-digits"])
def test_a_tracker_that_is_no_iteration(private_checkpoint, tmp_path, content):
    """Bytes that are not text (UnicodeDecodeError), and a number past Python's 4300-digit conversion limit
    (ValueError): both were tracebacks."""
    (private_checkpoint / TRACKER_FILE).write_bytes(content)
    refused(to_hf(private_checkpoint, tmp_path / "out"), tmp_path / "out", TRACKER_FILE, "neither 'release' nor an iteration number")


def test_a_legacy_checkpoint_carrying_an_unexpected_class(tmp_path):
    marker = tmp_path / "ran"
    path = legacy_checkpoint(tmp_path / "legacy", {"model": {}, "rng_state": _Marker(marker)})
    assert not marker.exists()
    refused(to_hf(tmp_path / "legacy", tmp_path / "out"), tmp_path / "out", path, "io.open", "not loaded")
    assert not marker.exists()


def test_a_legacy_rank_file_that_is_not_torch_save(tmp_path):
    path = legacy_checkpoint(tmp_path / "legacy", {})
    path.write_bytes(os.urandom(64))
    refused(to_hf(tmp_path / "legacy", tmp_path / "out"), tmp_path / "out", path, "not a torch.save file")


# Found by scripts/fuzz/fuzz_readers.py (atheris), each now a fixed case.


def test_a_config_a_familys_rules_read_unchecked(hf, tmp_path):
    """A DeepSeek config without num_attention_heads, which its rules indexed directly (KeyError)."""
    from mconvert.synthetic import real_config, shrink

    config = shrink(real_config("deepseek-v3"))
    del config["num_attention_heads"]
    (hf / "config.json").write_text(json.dumps(config))
    refused(to_mcore(hf, tmp_path / "out"), tmp_path / "out", "config.json", "num_attention_heads")


def test_a_config_field_a_familys_rules_cannot_take(hf, tmp_path):
    """A field of another type than transformers writes, where a family's rule computes with it (ValueError)."""
    write_config(hf, rms_norm_eps="small")
    refused(to_mcore(hf, tmp_path / "out"), tmp_path / "out", "config.json", "'small'")


def test_a_config_claiming_more_layers_than_any_model(hf, tmp_path):
    """10^12 layers: the conversion walks layers one by one (a DeepSeek config's first dense layers took the fuzzer
    past its time limit)."""
    write_config(hf, num_hidden_layers=10**12)
    refused(to_mcore(hf, tmp_path / "out"), tmp_path / "out", "config.json", "'num_hidden_layers' is 1000000000000", "at most 10000")


def test_metadata_claiming_a_huge_memo_is_read_in_bounded_memory(private_checkpoint, tmp_path):
    """A pickle whose LONG_BINPUT names memo slot 100,000,000: Python's C unpickler allocates a memo of twice that
    many slots (1.6 GB) before storing one value; the reader's does not."""
    metadata = private_checkpoint / RELEASE / ".metadata"
    metadata.write_bytes(b"\x80\x02N" + b"r" + struct.pack("<I", 100_000_000) + b".")
    probe = (
        "import resource, sys; from pathlib import Path; from mconvert.errors import ConversionError\n"
        "from mconvert.formats.dcp import DCPCheckpoint\n"
        "try: DCPCheckpoint(Path(sys.argv[1]))\nexcept ConversionError as e: print(e)\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)"
    )
    done = subprocess.run([sys.executable, "-c", probe, str(metadata.parent)], capture_output=True, text=True, check=True)
    message, peak_mb = done.stdout.splitlines()
    assert "holds a NoneType, not DCP metadata" in message and int(peak_mb) < 1000, done.stdout
    refused(to_hf(private_checkpoint, tmp_path / "out"), tmp_path / "out", metadata, "not DCP metadata")


@pytest.mark.parametrize("claim", ["chunk", "shape"])
def test_metadata_claiming_more_bytes_than_the_files_hold(private_checkpoint, tmp_path, claim):
    """A tensor of 10^8 rows where the data file holds 256 (its chunk claiming them, or its shape alone): reading it
    allocated 25.6 GB before it found the bytes missing. Every claim is now held against the files' sizes first."""
    metadata = private_checkpoint / RELEASE / ".metadata"
    stored = FileSystemReader(str(metadata.parent)).read_metadata()
    entry = stored.state_dict_metadata["embedding.word_embeddings.weight"]
    entry.size = torch.Size([10**8, *entry.size[1:]])
    if claim == "chunk":
        (chunk,) = entry.chunks
        chunk.sizes = entry.size
    metadata.write_bytes(pickle.dumps(stored))
    said = "its record in __0_0.distcp holds" if claim == "chunk" else "its chunks hold"
    refused(to_hf(private_checkpoint, tmp_path / "out"), tmp_path / "out", metadata, "embedding.word_embeddings.weight", said)


def test_metadata_naming_a_data_file_outside_the_checkpoint(private_checkpoint, tmp_path):
    metadata = private_checkpoint / RELEASE / ".metadata"
    stored = FileSystemReader(str(metadata.parent)).read_metadata()
    for info in stored.storage_data.values():
        info.relative_path = "../" + info.relative_path
    metadata.write_bytes(pickle.dumps(stored))
    refused(to_hf(private_checkpoint, tmp_path / "out"), tmp_path / "out", metadata, "not a file beside it")


def test_weights_stored_in_a_dtype_no_weights_have(private_checkpoint, tmp_path):
    """Found by fuzzing an FSDP save's .metadata (scripts/fuzz/fuzz_readers.py fsdp-save): the export's config was
    given a dtype it has no name for (StopIteration)."""
    metadata = private_checkpoint / RELEASE / ".metadata"
    stored = FileSystemReader(str(metadata.parent)).read_metadata()
    stored.state_dict_metadata["embedding.word_embeddings.weight"].properties.dtype = torch.int8
    metadata.write_bytes(pickle.dumps(stored))
    refused(to_hf(private_checkpoint, tmp_path / "out"), tmp_path / "out", RELEASE, "the word embedding is stored as int8")


def test_metadata_naming_a_value_by_a_number(private_checkpoint, tmp_path):
    """Found by fuzzing an FSDP save's .metadata: a stored value keyed by an int (AttributeError)."""
    metadata = private_checkpoint / RELEASE / ".metadata"
    stored = FileSystemReader(str(metadata.parent)).read_metadata()
    stored.state_dict_metadata[5] = stored.state_dict_metadata.pop("embedding.word_embeddings.weight")
    metadata.write_bytes(pickle.dumps(stored))
    refused(to_hf(private_checkpoint, tmp_path / "out"), tmp_path / "out", metadata, "names a stored value 5, which is not a name")


def test_metadata_storing_an_object_nowhere(tmp_path):
    """Found by fuzzing an FSDP save's .metadata: a stored object's record without its place in the data file
    (AttributeError). On a save Megatron-LM made (tests/fixtures/fsdp), whose args are such an object."""
    save = tmp_path / "save"
    shutil.copytree(Path(__file__).parent / "fixtures" / "fsdp" / "torch_dcp-llama" / "save", save)
    metadata = save / "iter_0000002" / ".metadata"
    stored = FileSystemReader(str(metadata.parent)).read_metadata()
    (record,) = [info for index, info in stored.storage_data.items() if index.fqn == "args"]
    record.offset = None
    metadata.write_bytes(pickle.dumps(stored))
    refused(to_hf(save, tmp_path / "out"), tmp_path / "out", metadata, "the record of where 'args' is stored has no place")


@pytest.mark.parametrize("where", [".metadata", "common.pt"])
def test_pickles_holding_cyclic_references(checkpoint, private_checkpoint, tmp_path, where):
    """A pickle whose objects refer to themselves (a dict inside itself in `.metadata`, args that hold themselves and a
    list inside itself in common.pt): read as any other, nothing walks the cycle; the conversion is the plain one."""
    release = private_checkpoint / RELEASE
    if where == ".metadata":
        stored = FileSystemReader(str(release)).read_metadata()
        stored.state_dict_metadata["loop"] = stored.state_dict_metadata
        (release / ".metadata").write_bytes(pickle.dumps(stored))
    else:
        common = torch.load(release / "common.pt", weights_only=False)
        loop = [1]
        loop.append(loop)
        common["args"].itself, common["args"].loop = common["args"], loop
        torch.save(common, release / "common.pt")
    done = to_hf(private_checkpoint, tmp_path / "out")
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert to_hf(checkpoint, tmp_path / "plain").returncode == 0
    assert same_files(tmp_path / "out", tmp_path / "plain")


@pytest.mark.parametrize("where", ["common.pt", "legacy"])
def test_a_torch_save_file_whose_zip_records_are_garbled(private_checkpoint, tmp_path, where):
    """torch.load fails inside its archive reader in ways of its own (UnicodeDecodeError, ValueError: an endianness
    record it cannot read): the same one line as any unreadable torch.save file."""
    path = private_checkpoint / RELEASE / "common.pt" if where == "common.pt" else legacy_checkpoint(tmp_path / "legacy", {"model": {}})
    data = bytearray(path.read_bytes())
    at = data.index(b"little", data.index(b"byteorder"))
    data[at : at + 6] = b"\xd0" * 6  # the byteorder record's text, no longer UTF-8
    path.write_bytes(bytes(data))
    checkpoint_dir = private_checkpoint if where == "common.pt" else tmp_path / "legacy"
    refused(to_hf(checkpoint_dir, tmp_path / "out"), tmp_path / "out", path, "torch.save file")


def test_a_legacy_rank_file_holding_no_dict(tmp_path):
    path = legacy_checkpoint(tmp_path / "legacy", "model")
    refused(to_hf(tmp_path / "legacy", tmp_path / "out"), tmp_path / "out", path, "holds a str")


def test_the_troubleshooting_table_names_these_tests():
    """docs/troubleshooting.md lists each message with the test that checks it: those tests exist."""
    import re

    from cli_runner import REPO

    table = (REPO / "docs" / "troubleshooting.md").read_text()
    named = set(re.findall(r"`(test_\w+)", table))
    defined = set(re.findall(r"^def (test_\w+)", "\n".join(p.read_text() for p in (REPO / "tests").glob("test_*.py")), re.MULTILINE))
    assert len(named) >= 25 and named <= defined, named - defined
