#!/usr/bin/env python3
"""`make deploy-check`, the slice of `make fleet-test` that `make test` runs: the compose files
and the Containerfile hold what the fleet test relies on, without building or starting them
(that is `make fleet-test`). Fails naming the file and what is wrong."""
import re
import sys
from pathlib import Path

import yaml

root = Path(__file__).resolve().parent.parent
problems = []


def check(ok, what):
    if not ok:
        problems.append(what)


containerfile = (root / "deploy/Containerfile").read_text()
check(re.search(r"^ARG BASE=", containerfile, re.M), "Containerfile: the base image is a build argument")
for need in ("COPY cachet /usr/local/bin/cachet", "COPY admin-ui/dist", "COPY models", "HEALTHCHECK", "USER cachet", "VOLUME /var/lib/cachet"):
    check(need in containerfile, f"Containerfile: {need!r}")
# The image's paths are the binary's defaults (relative to WORKDIR /opt/cachet).
config = (root / "src/config.rs").read_text()
check('ui_dir: "admin-ui/dist".into()' in config, "config: the admin UI's default path moved; update the Containerfile")
check('PathBuf::from(".cachet/models")' in (root / "engine/src/reference/mod.rs").read_text(),
      "the model's default path moved; update the Containerfile")

for name, roles in (("compose.serve.yaml", {"cachet": "serve"}),
                    ("compose.cluster.yaml", {"node1": "node", "node2": "node", "node3": "node", "router": "router"})):
    path = root / "deploy" / name
    text = path.read_text()
    doc = yaml.safe_load(text)
    services = doc.get("services", {})
    for svc in ("postgres", "redis"):
        check("healthcheck" in services.get(svc, {}), f"{name}: {svc} has a health check")
    check("pgdata:/var/lib/postgresql/data" in services.get("postgres", {}).get("volumes", []), f"{name}: Postgres's data on a volume")
    for svc, role in roles.items():
        s = services.get(svc)
        check(s is not None, f"{name}: service {svc}")
        if s is None:
            continue
        check(s.get("command", [None])[0] == role, f"{name}: {svc} runs `cachet {role}`")
        check("healthcheck" in s, f"{name}: {svc} has a health check")
        check(any(v.endswith(":/var/lib/cachet") for v in s.get("volumes", [])), f"{name}: {svc}'s data directory on a volume")
        deps = s.get("depends_on", {})
        check(all(deps.get(d, {}).get("condition") == "service_healthy" for d in ("postgres", "redis")),
              f"{name}: {svc} waits for healthy Postgres and Redis")
        env = s.get("environment", {})
        check("${POSTGRES_PASSWORD}" in env.get("DATABASE_URL", ""), f"{name}: {svc}'s database password from the environment")
        if role == "node":
            cmd = s["command"]
            check(f"{svc}:7400" in cmd and f"{svc}:8080" in cmd, f"{name}: {svc} advertises its service name")
            check(s.get("shm_size"), f"{name}: {svc} sizes /dev/shm for the KV arena")
    # Secrets are never written in the file, only taken from the environment.
    check(not re.search(r"(PASSWORD|TOKEN|SECRET): [^$\s]", text), f"{name}: a secret written in the file")
    check("${POSTGRES_PASSWORD:?" in text, f"{name}: POSTGRES_PASSWORD required")
cluster = (root / "deploy/compose.cluster.yaml").read_text()
check("${CACHET_CLUSTER_TOKEN:?" in cluster, "compose.cluster.yaml: CACHET_CLUSTER_TOKEN required")

if problems:
    sys.exit("deploy-check:\n  " + "\n  ".join(problems))
print("deploy-check: the Containerfile and both compose files hold what the fleet test relies on")
