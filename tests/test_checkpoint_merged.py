"""The merged export (`?format=merged`): a step's LoRA merged into its base, a Hugging Face
directory in a tar that `AutoModelForCausalLM.from_pretrained` loads with the logits PEFT
gives the base with the adapter; real torch, peft and transformers on tiny models, real
HTTP. The merge itself against PEFT's own `merge_and_unload`: sharded and bf16 bases,
rank and alpha patterns, rsLoRA, `modules_to_save`, GPT-2's transposed (`fan_in_fan_out`)
weights; and what it refuses, before a byte is sent."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path
from typing import Any

import pytest

from app.backends.tiny_model import make_tiny_model
from app.checkpoints import merge
from tests.test_checkpoints import PROBLEM, _checkpoints_dir, _register, _train

pytestmark = pytest.mark.torch
PROBE = [[1, 2, 3, 4, 5, 9, 30, 12]]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("merged-models") / "tiny")


def _logits(model: Any) -> Any:
    import torch

    with torch.no_grad():
        return model(input_ids=torch.tensor(PROBE)).logits.float()


def _untar(content: bytes, out: Path) -> list[str]:
    with tarfile.open(fileobj=io.BytesIO(content), mode="r:") as tar:
        names = sorted(tar.getnames())
        tar.extractall(out, filter="data")
    return names


def _refused(response: Any, slug: str) -> dict:
    assert response.status_code == 409, response.text
    assert response.headers["content-type"] == PROBLEM
    problem = response.json()
    assert problem["type"] == f"urn:trainyard:problem:{slug}"
    assert [(e["location"], e["path"]) for e in problem["errors"]] == [("query", "format")]
    return problem


async def test_merged_export_loads_with_the_adapters_logits(serve, tiny_model, tmp_path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    async with serve(worker_enabled=True, model_roots=[tiny_model.parent]) as live:
        await _register(live.client, tiny_model)
        await _train(live)
        url = "/v1/models/toy/checkpoints/1/export"
        response = await live.client.get(url, params={"format": "merged"})
        assert response.status_code == 200, response.text
        assert response.headers["content-type"] == "application/octet-stream"
        disposition = response.headers["content-disposition"]
        assert 'filename="toy-step0001-merged.tar"' in disposition
        assert int(response.headers["content-length"]) == len(response.content)
        missing = await live.client.get("/v1/models/toy/checkpoints/7/export?format=merged")
        assert missing.status_code == 404
        bad = await live.client.get(url, params={"format": "merge"})
        assert bad.status_code == 422
        assert [(e["location"], e["path"]) for e in bad.json()["errors"]] == [("query", "format")]

    # The same checkpoints, served where the base is outside the model roots: refused.
    async with serve(model_roots=[]) as api:
        problem = _refused(await api.client.get(url, params={"format": "merged"}), "base-not-local")
        assert "format=tar.gz" in problem["detail"]
        assert (await api.client.get(url)).status_code == 200  # the adapter still exports

    out = tmp_path / "merged"
    names = _untar(response.content, out)
    folder = out / "toy-step0001-merged"
    expected = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"}
    assert expected <= {Path(n).name for n in names}
    assert all(n.startswith("toy-step0001-merged/") for n in names)
    assert not any(n.endswith(("adapter_model.safetensors", "optimizer.pt")) for n in names)
    for small in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (folder / small).read_bytes() == (tiny_model / small).read_bytes()

    base = AutoModelForCausalLM.from_pretrained(tiny_model, local_files_only=True)
    base_logits = _logits(base)
    checkpoint = _checkpoints_dir(tmp_path / "data") / "0001"
    with_adapter = _logits(PeftModel.from_pretrained(base, checkpoint))
    merged = _logits(AutoModelForCausalLM.from_pretrained(folder, local_files_only=True))
    assert merged.allclose(with_adapter, atol=1e-4, rtol=1e-4)
    assert not merged.allclose(base_logits, atol=1e-2)  # the step trained something


def _adapter(base_dir: Path, out: Path, *, seed: int = 1, **lora: Any) -> Any:
    """A LoRA on the model at `base_dir`, saved to `out`, with every weight random (B too:
    a fresh adapter's B is zero, which a merge that did nothing would pass)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, local_files_only=True)
    peft_model = get_peft_model(model, LoraConfig(lora_dropout=0.0, **lora))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in peft_model.parameters():
            if parameter.requires_grad:
                noise = torch.randn(parameter.shape, generator=generator) * 0.3
                parameter.copy_(noise.to(parameter.dtype))
    peft_model.save_pretrained(str(out))
    return peft_model


def _export(base: Path, adapter: Path, out: Path, roots: list[Path] | None = None) -> Path:
    planned = merge.plan(
        base=base, adapter_dir=adapter, folder="m", roots=roots or [base.parent, adapter.parent]
    )
    content = b"".join(planned.chunks())
    assert len(content) == planned.size
    _untar(content, out)
    return out / "m"


def _assert_merged_like_peft(peft_model: Any, folder: Path, atol: float) -> None:
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    with_adapter = _logits(peft_model)
    reference = peft_model.merge_and_unload()
    for name, tensor in reference.state_dict().items():
        ours = merged.state_dict()[name]
        assert ours.dtype == tensor.dtype, name
        assert ours.float().allclose(tensor.float(), atol=atol, rtol=atol), name
    assert _logits(merged).allclose(with_adapter, atol=atol * 10, rtol=atol * 10)


def test_a_sharded_base_with_patterns_rslora_and_modules_to_save(tiny_model, tmp_path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = tmp_path / "sharded"
    model = AutoModelForCausalLM.from_pretrained(tiny_model, local_files_only=True)
    model.save_pretrained(base, max_shard_size="40KB")
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(base)
    shards = json.loads((base / merge.INDEX).read_text())["weight_map"].values()
    assert len(set(shards)) > 3
    peft_model = _adapter(
        base,
        tmp_path / "adapter",
        r=4,
        lora_alpha=16,
        target_modules=["q_proj", "v_proj", "down_proj"],
        rank_pattern={"down_proj": 2},
        alpha_pattern={r"layers\.1\.self_attn\.q_proj": 3},
        use_rslora=True,
        modules_to_save=["lm_head"],
    )
    folder = _export(base, tmp_path / "adapter", tmp_path / "out")
    assert sorted(p.name for p in folder.glob("*.safetensors")) == sorted(set(shards))
    assert (folder / merge.INDEX).read_bytes() == (base / merge.INDEX).read_bytes()
    _assert_merged_like_peft(peft_model, folder, atol=1e-5)


def test_a_bf16_base(tiny_model, tmp_path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    base = tmp_path / "bf16"
    model = AutoModelForCausalLM.from_pretrained(tiny_model, local_files_only=True)
    model.to(torch.bfloat16).save_pretrained(base)
    peft_model = _adapter(
        base, tmp_path / "adapter", r=8, lora_alpha=16, target_modules="all-linear"
    )
    folder = _export(base, tmp_path / "adapter", tmp_path / "out")
    # PEFT adds B @ A in bf16, the export in float32 before rounding: one bf16 step apart
    _assert_merged_like_peft(peft_model, folder, atol=2e-2)


def test_gpt2s_transposed_weights(tmp_path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    from app.backends.seeding import seeded

    base = tmp_path / "gpt2"
    with seeded(0):
        model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64))
    model.save_pretrained(base)
    peft_model = _adapter(
        base, tmp_path / "adapter", r=4, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True
    )
    folder = _export(base, tmp_path / "adapter", tmp_path / "out")
    _assert_merged_like_peft(peft_model, folder, atol=1e-5)


def _refusal(base: Path, adapter: Path, roots: list[Path] | None = None) -> merge.Refusal:
    with pytest.raises(merge.Refusal) as caught:
        merge.plan(base=base, adapter_dir=adapter, folder="m", roots=roots or [base.parent])
    return caught.value


def test_what_cannot_be_merged_is_refused_before_a_byte(tiny_model, tmp_path) -> None:
    import shutil

    _adapter(tiny_model, tmp_path / "dora", r=4, target_modules=["q_proj"], use_dora=True)
    refused = _refusal(tiny_model, tmp_path / "dora")
    assert (refused.kind, "DoRA" in str(refused)) == ("not-mergeable", True)

    adapter = tmp_path / "plain"
    _adapter(tiny_model, adapter, r=4, target_modules=["q_proj"])

    def copy(name: str) -> Path:
        target = tmp_path / name
        shutil.copytree(tiny_model, target)
        return target

    quantized = copy("quantized")
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (quantized / "config.json").write_text(json.dumps(config))
    assert "quantized" in str(_refusal(quantized, adapter))

    pickled = copy("pickled")
    (pickled / "model.safetensors").rename(pickled / "pytorch_model.bin")
    assert "no safetensors" in str(_refusal(pickled, adapter))

    escaping = copy("escaping")
    (escaping / merge.INDEX).write_text(
        json.dumps({"weight_map": {"x": "../tiny/model.safetensors"}})
    )
    assert "outside its directory" in str(_refusal(escaping, adapter))

    linked = copy("linked")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "tokenizer.json").write_text("{}")
    (linked / "tokenizer.json").unlink()
    (linked / "tokenizer.json").symlink_to(outside / "tokenizer.json")
    refused = _refusal(linked, adapter, roots=[linked])
    assert refused.kind == "base-not-local"

    other = copy("other")  # a base whose weights the adapter does not fit
    narrower = make_tiny_model(tmp_path / "narrower", hidden_size=32)
    _adapter(narrower, tmp_path / "narrow", r=4, target_modules=["q_proj"])
    assert "does not fit" in str(_refusal(other, tmp_path / "narrow"))


class _ArtLocal:
    """Where ART's LocalBackend keeps checkpoints (`_path`), and nothing else of it: the
    registry reads its checkpoints from disk and never calls it."""

    def __init__(self, path: Path) -> None:
        self._path = str(path)

    async def close(self) -> None:
        return None


async def test_art_local_checkpoints_merge_when_the_base_is_a_local_directory(
    serve, tiny_model, tmp_path
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    art = tmp_path / "art"
    overrides = {"art-local": _ArtLocal(art)}
    async with serve(backend_overrides=overrides, model_roots=[tiny_model.parent]) as live:
        for name, base in (("local", str(tiny_model)), ("hub", "Qwen/Qwen2.5-0.5B-Instruct")):
            body = {"name": name, "project": "p", "base_model": base, "backend": "art-local"}
            assert (await live.client.post("/v1/models", json=body)).status_code == 201
            # as ART's LocalBackend lays a step out: {art_path}/{project}/models/{name}/...
            _adapter(tiny_model, art / "p" / "models" / name / "checkpoints" / "0001", r=4,
                     target_modules=["q_proj", "v_proj"])  # fmt: skip
        response = await live.client.get(
            "/v1/models/local/checkpoints/1/export", params={"format": "merged"}
        )
        assert response.status_code == 200, response.text
        hub = await live.client.get("/v1/models/hub/checkpoints/1/export?format=merged")
        problem = _refused(hub, "base-not-local")
        assert "Qwen/Qwen2.5-0.5B-Instruct" in problem["detail"]

    _untar(response.content, tmp_path / "out")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "local-step0001-merged")
    base = AutoModelForCausalLM.from_pretrained(tiny_model, local_files_only=True)
    step = art / "p" / "models" / "local" / "checkpoints" / "0001"
    with_adapter = _logits(PeftModel.from_pretrained(base, step))
    assert _logits(merged).allclose(with_adapter, atol=1e-4, rtol=1e-4)


def _open_under(directory: Path) -> list[str]:
    """This process's open files under `directory` (the server runs in it)."""
    opened = []
    for fd in Path("/proc/self/fd").iterdir():
        try:
            target = fd.readlink()
        except OSError:  # closed meanwhile
            continue
        if target.is_relative_to(directory):
            opened.append(str(target))
    return opened


async def test_a_client_that_goes_away_mid_export_leaves_no_file_open(
    serve, tiny_model, tmp_path
) -> None:
    import asyncio

    async with serve(worker_enabled=True, model_roots=[tiny_model.parent]) as live:
        await _register(live.client, tiny_model)
        await _train(live)
        url = "/v1/models/toy/checkpoints/1/export?format=merged"
        async with live.client.stream("GET", url) as response:
            assert response.status_code == 200
            async for _ in response.aiter_raw(1024):
                assert _open_under(tiny_model)  # the export holds the base's files
                break
        for _ in range(200):
            if not _open_under(tiny_model) and not _open_under(tmp_path / "data"):
                break
            await asyncio.sleep(0.05)
        assert _open_under(tiny_model) == [] and _open_under(tmp_path / "data") == []
        whole = await live.client.get(url)  # and the next export is whole
        assert int(whole.headers["content-length"]) == len(whole.content)
        head = await live.client.head(url)  # its headers, the merge planned but never run
        assert (head.status_code, head.content) == (200, b"")
        assert head.headers["content-length"] == whole.headers["content-length"]
        for _ in range(200):
            if not _open_under(tiny_model):
                break
            await asyncio.sleep(0.05)
        assert _open_under(tiny_model) == []
