"""EPD topologies: images through encoder -> prefill -> decode, verified token for token
against a colocated server that runs the encoder in-process, on every transport."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import yaml

from pdctl.core import MODEL_PRESETS
from pdctl.launch.plan import load_checked, make_plan
from pdctl.launch.run import Run
from pdctl.serve.model.encoder import EncoderModel, parse_image
from pdctl.serve.multimodal import digest_of
from pdctl.verify.workload import image
from tests.conftest import REPO
from tests.verify.test_verify import QUICK, env, report_of, verify  # noqa: F401

EPD = REPO / "topologies" / "cpu-epd-p1d2-tcp.yaml"
GREEDY = {"temperature": 0, "max_new_tokens": 6}


def variant(tmp_path: Path, backend: str, encoder_tp: int = 1) -> Path:
    data = yaml.safe_load(EPD.read_text())
    data["transfer"]["backend"] = backend
    data["roles"]["encoder"]["tp"] = encoder_tp
    path = tmp_path / f"epd-{backend}-e{encoder_tp}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.mark.parametrize("backend", ["tcp", "mooncake", "nixl"])
def test_epd_verifies_token_exact_against_the_colocated_encoder(
    env: dict[str, str],  # noqa: F811
    tmp_path: Path,
    backend: str,
) -> None:
    out = tmp_path / "verify.json"
    result = verify(env, str(variant(tmp_path, backend)), "--serial-compare", "--reference",
                    *QUICK, "--json", str(out))  # fmt: skip
    report = report_of(out)
    assert result.returncode == 0, (result.stderr, report["findings"])
    assert report["verdict"] == "pass"
    prompts = report["passes"][0]["requests"]
    assert sum(1 for p in report["workload"]["prompts"] if p["images"]) >= 4, report["workload"]
    assert all(r["ok"] for r in prompts)
    with_images = {p["id"] for p in report["workload"]["prompts"] if p["images"]}
    for request in prompts:  # the digest prefill checked is in every EPD request's record
        moved = request["embedding_transfer"]
        if request["id"] in with_images:
            assert moved["digest_ok"] and moved["bytes"] > 0 and moved["transport"] == backend
            assert moved["num_image_tokens"] >= 4
        else:
            assert moved is None
    reference = next(p for p in report["passes"] if p["name"] == "reference")
    assert reference["requests"] and all(r["ok"] for r in reference["requests"])


def verify_failing(environ: dict[str, str], tmp_path: Path, fault: str) -> dict[str, Any]:
    """The catalog EPD topology verified with `fault` injected: it must fail (exit 1)."""
    out = tmp_path / "verify.json"
    result = verify(environ, str(EPD), "--inject", fault, *QUICK, "--json", str(out))
    report = report_of(out)
    assert result.returncode == 1
    return report


def test_a_corrupted_embedding_is_caught_and_classified(
    env: dict[str, str],  # noqa: F811
    tmp_path: Path,
) -> None:
    report = verify_failing(env, tmp_path, "corrupt-embedding:every=2")
    kinds = {f["classification"] for f in report["findings"]}
    # every failed request is the corruption; a prefix family whose requests were the
    # corrupted ones can also leave the prefix-hit pass without a hit
    assert "embedding-corruption" in kinds and kinds <= {"embedding-corruption", "cache-miss"}, (
        report["findings"]
    )
    evidence = next(f for f in report["findings"] if f["classification"] == "embedding-corruption")[
        "evidence"
    ]
    assert evidence["sent"] != evidence["received"]
    assert evidence["where"] == "encoder -> prefill embedding pool"


def picture(seed: int, height: int = 16, width: int = 16) -> dict[str, Any]:
    """A base64 uint8 image, as verify's workload makes them."""
    return dict(image(random.Random(seed), height, width, raw=True))


@pytest.fixture(scope="module")
def epd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    """The catalog's EPD topology with a TP 2 encoder (the model sharded over 2 ranks)."""
    where = tmp_path_factory.mktemp("epd")
    run = Run(make_plan(load_checked(variant(where, "tcp", encoder_tp=2))), where / "run")
    run.start()
    try:
        run.wait_ready(timeout=180)
        yield run
    finally:
        assert run.stop() == []


def generate(run: Run, **body: Any) -> httpx.Response:
    return httpx.post(
        f"{run.router_url}/generate", json={**body, "sampling_params": GREEDY}, timeout=60
    )


def test_images_change_the_answer_and_the_cache_never_mixes_them(epd: Run) -> None:
    first = generate(epd, text="Look: <image> What is it?", image=picture(1)).json()
    other = generate(epd, text="Look: <image> What is it?", image=picture(2)).json()
    again = generate(epd, text="Look: <image> What is it?", image=picture(1)).json()
    assert first["output_ids"] == again["output_ids"] != other["output_ids"]
    # 6 text tokens + 16 image positions + 12: the same image hits the cache past its
    # positions; another image shares only the text before it (no full page of it)
    assert first["meta_info"]["prompt_tokens"] == 6 + 16 + 12
    assert again["meta_info"]["cached_tokens"] >= 16
    assert other["meta_info"]["cached_tokens"] == 0


def test_markers_in_input_ids_and_images_first_by_default(epd: Run) -> None:
    marked = generate(epd, input_ids=[-1, 5, 6, 7], image=picture(3)).json()
    unmarked = generate(epd, input_ids=[5, 6, 7], image=picture(3)).json()
    assert marked["output_ids"] == unmarked["output_ids"]
    two = generate(epd, input_ids=[5, -1, 6, -1, 7], images=[picture(3), picture(4, 8, 4)])
    assert two.status_code == 200 and two.json()["meta_info"]["prompt_tokens"] == 3 + 16 + 2


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        ({"text": "<image><image>", "image": picture(5)}, 400, "marks 2 image(s)"),
        ({"text": "x", "image": [[1.0]]}, 400, "image: "),
        ({"text": "x", "image": {"data": "!!", "dtype": "uint8", "shape": [3, 4, 4]}}, 400,
         "image.data"),
        ({"text": "x", "image": picture(6, 6, 8)}, 400, "not a multiple of the patch size"),
        ({"text": "x", "images": []}, 400, "non-empty"),
        ({"input_ids": [5, -2], "image": picture(7)}, 400, "outside the vocabulary"),
        ({"text": "x", "image": picture(8), "images": [picture(8)]}, 400, "not both"),
    ],
)  # fmt: skip
def test_bad_images_are_400s_naming_the_field(
    epd: Run, body: dict[str, Any], status: int, words: str
) -> None:
    response = generate(epd, **body)
    assert response.status_code == status, response.text
    assert words in response.json()["error"]["message"], response.text
    ok, held, _ = epd.pools_back(timeout=10)
    assert ok, held
    assert generate(epd, text="still <image> serving", image=picture(9)).status_code == 200


def test_a_tp2_encoder_sends_bitwise_the_tp1_embeddings(epd: Run) -> None:
    """Across processes: the digest of what the TP 2 encoder sent (prefill checked it)
    is the digest of one in-process TP 1 encoder's rows for the same images."""
    model = EncoderModel(MODEL_PRESETS["tiny"].hidden_size, seed=0)
    for images in ([picture(11)], [picture(12, 8, 12), picture(13, 64, 64)]):
        answer = generate(epd, input_ids=[5] + [-1] * len(images), images=images).json()
        rows = torch.cat([model.encode(parse_image(image)) for image in images])
        moved = answer["meta_info"]["embedding_transfer"]
        assert moved["digest"] == f"{digest_of(rows):#018x}" and moved["digest_ok"], moved
    info = httpx.get(f"{epd.state('encoder-0').url}/get_server_info", timeout=10).json()
    assert info["tp"] == 2, info


def test_images_need_an_encoder(epd: Run) -> None:
    prefill = epd.state("prefill-0").url
    direct = httpx.post(f"{prefill}/generate", json={"text": "x", "image": picture(1)}, timeout=30)
    assert direct.status_code == 400
    assert "runs no encoder" in direct.json()["error"]["message"]
    # through the router the image goes to the encoder (this test's own, whatever ran before)
    assert generate(epd, input_ids=[5, -1], images=[picture(2)]).status_code == 200
    info = httpx.get(f"{epd.state('encoder-0').url}/get_server_info", timeout=10).json()
    assert info["role"] == "encoder" and info["encoder"]["requests"] >= 1
    prefill_info = httpx.get(f"{prefill}/get_server_info", timeout=10).json()
    assert prefill_info["embeddings"]["rooms"] >= 1 and prefill_info["embeddings"]["open"] == 0
    json.dumps(prefill_info)


def test_an_encoder_that_dies_is_named(
    env: dict[str, str],  # noqa: F811
    tmp_path: Path,
) -> None:
    report = verify_failing(env, tmp_path, "kill-role:role=encoder,after=2")
    died = [f for f in report["findings"] if f["classification"] == "role-died"]
    assert died and "encoder-0" in died[0]["message"], report["findings"]
