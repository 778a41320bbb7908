"""Renders and lints the Helm chart with Helm's own library (helm-python-sdk: Helm's Go SDK
as a C library, no helm binary). Run by tests/it/helm_chart.rs:

    python tests/python/helm_chart.py CHART_DIR < request.json

The request: {"name": release, "namespace": ns, "values": {...}}. Prints one JSON object:
{"manifests": {template path: rendered text}, "lint": Helm's lint report (strict)}.
"""

import json
import sys

try:
    import helm_python as helm
except ImportError as err:  # pragma: no cover - a set-up problem, said plainly
    sys.exit(f"helm_python is missing from this venv ({err}): ./dev setup installs tests/python/requirements.txt")


def main() -> None:
    chart_dir = sys.argv[1]
    request = json.load(sys.stdin)
    chart = helm.Chart.load(chart_dir)
    manifests = chart.render(
        request.get("values") or None,
        name=request["name"],
        namespace=request["namespace"],
        is_install=True,
    )
    lint = helm.lint(
        chart_dir,
        request.get("values") or None,
        strict=True,
        namespace=request["namespace"],
    )
    json.dump(
        {
            "helm": helm.helm_sdk_version(),
            "manifests": manifests,
            "lint": lint,
        },
        sys.stdout,
    )


if __name__ == "__main__":
    main()
