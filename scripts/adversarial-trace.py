#!/usr/bin/env python3
"""Writes an adversarial Mooncake-format trace to stdout (docs/benchmarks.md, "Eviction policies over several workloads")."""
# Adversarial: phases alternate between a scan with a hot set (frequency wins) and
# interleaved growing conversations (recency wins), so a policy tuned to one phase loses the next.
import json, random, sys
random.seed(11)
out = sys.stdout
ts = 0
nid = 10_000_000
hot = [[1_000 + h*100 + k for k in range(12)] for h in range(40)]
for phase in range(6):
    if phase % 2 == 0:
        for r in range(2500):
            if random.random() < 0.5:
                ids = hot[min(int(random.paretovariate(1.2)) - 1, 39)]
            else:
                ids = [nid + k for k in range(random.randint(4, 24))]; nid += 100
            out.write(json.dumps({"timestamp": ts, "input_length": 512*len(ids), "output_length": 50, "hash_ids": ids}) + "\n"); ts += 100
    else:
        active = {}
        for r in range(2500):
            if len(active) < 24 or random.random() < 0.05:
                active[nid] = [nid]; nid += 1000
            s = random.choice(list(active))
            chain = active[s]
            chain.extend(chain[-1] + 1 + k for k in range(random.randint(1, 3)))
            ids = [7] + chain
            out.write(json.dumps({"timestamp": ts, "input_length": 512*len(ids), "output_length": 50, "hash_ids": ids}) + "\n"); ts += 100
            if len(chain) > 40:
                del active[s]
