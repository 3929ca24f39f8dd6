"""Scale-out options: the Serve config example, flags to Serve's deployment options."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagewarden.serve.options import ServeOptions, ServeOptionsError

pytest.importorskip("ray", reason="Ray Serve is not installed: pip install 'pagewarden[ray]'")


def test_the_example_serve_config_builds():
    pytest.importorskip("ray", reason="Ray Serve is not installed: pip install 'pagewarden[ray]'")
    import yaml

    from pagewarden.serve.ray import ENGINE_DEPLOYMENT, INGRESS_DEPLOYMENT, app_builder

    config = yaml.safe_load((Path(__file__).parents[2] / "examples/serve-config.yaml").read_text())
    (app,) = config["applications"]
    assert app["import_path"] == "pagewarden.serve.ray:app_builder"
    assert app_builder(app["args"]) is not None
    assert {d["name"] for d in app["deployments"]} == {ENGINE_DEPLOYMENT, INGRESS_DEPLOYMENT}
    with pytest.raises(ValueError, match="unknown pagewarden serve args"):
        app_builder({"replicas": 2})


def test_options_become_serve_deployment_options():
    from pagewarden.serve.ray import engine_deployment_options

    fixed = engine_deployment_options(ServeOptions(num_replicas=3, max_queued_requests=50))
    assert fixed["num_replicas"] == 3 and "autoscaling_config" not in fixed
    assert fixed["max_queued_requests"] == 50
    assert fixed["request_router_config"].request_router_kwargs == {"imbalanced_threshold": 8}
    auto = engine_deployment_options(
        ServeOptions(min_replicas=1, max_replicas=4, target_ongoing_requests=8, router="pow2")
    )
    assert "num_replicas" not in auto and "request_router_config" not in auto
    a = auto["autoscaling_config"]
    assert (a.min_replicas, a.max_replicas, a.target_ongoing_requests) == (1, 4, 8)
    with pytest.raises(ServeOptionsError):
        ServeOptions(min_replicas=5, max_replicas=4)
