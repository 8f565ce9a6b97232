"""The GPU catalog: seeded from NVIDIA's datasheets, extended by users."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi.testclient import TestClient

API = "/api/v1"
SEEDED = {
    "RTX 3090 Ti", "RTX 3090", "RTX 8000", "V100 PCIe", "V100 SXM2", "T4", "A10", "L4",
    "A100 40GB", "A100 80GB", "H100 SXM", "H100 PCIe", "H200",
}


def _catalog(client: TestClient) -> dict[str, dict[str, Any]]:
    return {g["name"]: g for g in client.get(f"{API}/gpu-models", params={"limit": 1000}).json()["data"]}


def test_catalog_is_seeded_with_every_required_model_and_its_source(client: TestClient) -> None:
    catalog = _catalog(client)
    assert SEEDED <= catalog.keys()
    for name in SEEDED:
        assert catalog[name]["seeded"] is True
        assert "nvidia" in catalog[name]["source"].lower(), name


def test_seeded_figures_match_the_datasheets(client: TestClient) -> None:
    catalog = _catalog(client)
    figures = {name: (g["memory_gb"], g["fp32_tflops"], g["fp16_tflops"]) for name, g in catalog.items()}
    assert figures["T4"] == (16, 8.1, 65)
    assert figures["V100 SXM2"] == (16, 15.7, 125)
    assert figures["A100 80GB"] == (80, 19.5, 312)
    assert figures["H100 SXM"] == (80, 67, 989)
    assert figures["H200"] == (141, 67, 989)


def test_create_gpu_model_adds_a_user_entry(client: TestClient) -> None:
    body = {"name": "RTX 4090", "memory_gb": 24, "fp32_tflops": 82.6, "fp16_tflops": 165.2, "source": "mine"}
    response = client.post(f"{API}/gpu-models", json=body)
    assert response.status_code == 201
    assert response.json()["seeded"] is False
    assert response.json()["vendor"] == "NVIDIA"


def test_create_gpu_model_rejects_a_taken_name(client: TestClient) -> None:
    body = {"name": "T4", "memory_gb": 16, "fp32_tflops": 8, "fp16_tflops": 65}
    assert client.post(f"{API}/gpu-models", json=body).status_code == 409


def test_create_gpu_model_rejects_non_positive_figures_naming_the_field(client: TestClient) -> None:
    body = {"name": "broken", "memory_gb": 16, "fp32_tflops": 0, "fp16_tflops": 65}
    response = client.post(f"{API}/gpu-models", json=body)
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == ["body", "fp32_tflops"]


def test_update_gpu_model_changes_a_figure(client: TestClient) -> None:
    created = client.post(
        f"{API}/gpu-models", json={"name": "X1", "memory_gb": 8, "fp32_tflops": 1, "fp16_tflops": 2}
    ).json()
    response = client.patch(f"{API}/gpu-models/{created['id']}", json={"memory_gb": 16})
    assert response.status_code == 200 and response.json()["memory_gb"] == 16


def test_delete_gpu_model_in_use_by_a_node_is_refused(client: TestClient, make_node: Callable[..., dict[str, Any]]) -> None:
    created = client.post(
        f"{API}/gpu-models", json={"name": "X2", "memory_gb": 8, "fp32_tflops": 1, "fp16_tflops": 2}
    ).json()
    make_node(gpus=[{"model": "X2", "count": 1}])
    assert client.delete(f"{API}/gpu-models/{created['id']}").status_code == 409


def test_delete_gpu_model_with_prices_is_refused(client: TestClient) -> None:
    t4 = _catalog(client)["T4"]
    assert client.delete(f"{API}/gpu-models/{t4['id']}").status_code == 409


def test_delete_unused_gpu_model_removes_it(client: TestClient) -> None:
    created = client.post(
        f"{API}/gpu-models", json={"name": "X3", "memory_gb": 8, "fp32_tflops": 1, "fp16_tflops": 2}
    ).json()
    assert client.delete(f"{API}/gpu-models/{created['id']}").status_code == 204
    assert client.get(f"{API}/gpu-models/{created['id']}").status_code == 404


def test_a_vendor_or_form_factor_longer_than_its_column_gets_422_naming_it(client: TestClient) -> None:
    body = {"name": "Long", "memory_gb": 24, "fp32_tflops": 1, "fp16_tflops": 2}
    for field in ("vendor", "form_factor"):
        response = client.post(f"{API}/gpu-models", json=body | {field: "v" * 33})
        assert response.status_code == 422, response.text
        assert response.json()["detail"][0]["loc"] == ["body", field]
        assert client.post(f"{API}/gpu-models", json=body | {"name": f"ok-{field}", field: "v" * 32}).status_code == 201
