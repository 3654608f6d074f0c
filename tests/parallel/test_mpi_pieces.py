"""MPI transfers above its int count limit (2^31 - 1 elements) go in pieces (comm/mpi_comm.cpp): the
all-reduce, reduce-scatter, all-gather, broadcast, send and receive in pieces of at most that many
elements, the all-to-all and all-gather of variable counts in units of their counts' greatest common
divisor (the dispatcher's rows), the variable reduce-scatter as a reduction onto each rank in pieces.
Such transfers need gigabytes, so ORIGAMI_TEST_MPI_MAX_COUNT=97 lowers the limit and every layout below
runs each of its transfers through those paths: 6 AdamW steps give every step's loss within 1e-6
(relative) of the same layout's run without pieces (only MPI's choice of algorithm per message size may
change a summation order) and the same bytes per communicator (comm_bytes counts the transfers, not
their pieces), and the metrics' mpi_transfers_in_pieces shows the pieces paths ran (none without the
lowered limit). Layouts: llama DP2 with ZeRO 0 (all-reduce), 1 and 2 (reduce-scatter in place,
all-gather) and 3 (gathers per layer), TP2+SP, PP2 (sends and receives), CP2 (the ring), DP4 ZeRO-1
(4 ranks: reduce-scatter onto each of several ranks); mixtral EP2 (all-to-all of rows), EP2xETP2 (the
all-gather of rows) and FSSDP over DP2 (variable all-gather and reduce-scatter of experts).
"""
import os

import harness as h

RTOL = 1e-6
PIECES = {"ORIGAMI_TEST_MPI_MAX_COUNT": "97"}
LAYOUTS = [
    ("llama_tiny", 2, ["--zero", "0"]),
    ("llama_tiny", 2, ["--zero", "1"]),
    ("llama_tiny", 2, ["--zero", "2"]),
    ("llama_tiny", 2, ["--zero", "3"]),
    ("llama_tiny", 4, ["--zero", "1"]),
    ("llama_tiny", 2, ["--tp", "2", "--sequence-parallel"]),
    ("llama_tiny", 2, ["--pp", "2"]),
    ("llama_gqa2", 2, ["--cp", "2"]),
    ("mixtral_8e", 2, ["--ep", "2"]),
    ("mixtral_8e", 4, ["--ep", "2", "--etp", "2"]),
    ("mixtral_8e", 2, ["--expert-sharding", "fssdp"]),
]


def main():
    failures = []
    tmp = h.tmpdir("origami_mpi_pieces_")
    data = h.prepare_data(tmp)
    for model, ranks, flags in LAYOUTS:
        name = "%s %s on %d" % (model, " ".join(flags), ranks)
        runs = []
        for tag, env in (("whole", None), ("pieces", PIECES)):
            metrics = os.path.join(tmp, "%s_%s.jsonl" % (tag, len(runs)))
            rc, out, _ = h.run(ranks, ["train", "--config", os.path.join(h.CONFIGS, model + ".json"), "--data", data,
                                       "--steps", "6", "--seq-len", "32", "--micro-batch", "2", "--global-batch", "8",
                                       "--lr", "3e-3", "--threads", "1", "--quiet", "--metrics", metrics, *flags],
                               extra_env=env)
            runs.append(h.read_metrics(metrics) if rc == 0 else None)
            if rc != 0:
                failures.append("%s (%s): exit %s: %s" % (name, tag, rc, out[-500:]))
        if None in runs:
            continue
        whole, pieces = runs
        worst = max(abs(a["loss"] - b["loss"]) / abs(a["loss"]) for a, b in zip(whole, pieces))
        same_bytes = [a["comm_bytes"] for a in whole] == [b["comm_bytes"] for b in pieces]
        # the pieces path ran (the limit applied), and only under the lowered limit
        split = (whole[-1].get("mpi_transfers_in_pieces", 0), pieces[-1].get("mpi_transfers_in_pieces", 0))
        ok = len(whole) == len(pieces) == 6 and worst <= RTOL and same_bytes and split[0] == 0 and split[1] > 0
        print("%-4s %-55s loss within %.1e, bytes %s, transfers in pieces %d (without the limit %d)" % (
            "ok" if ok else "FAIL", name, worst, "equal" if same_bytes else "DIFFER", split[1], split[0]), flush=True)
        if not ok:
            failures.append("%s: in pieces the losses differ by %.2e (bound %.0e), bytes %s, transfers in pieces %s "
                            "(without the limit %s)" % (name, worst, RTOL, "equal" if same_bytes else "differ: %s vs %s" % (
                                whole[0]["comm_bytes"], pieces[0]["comm_bytes"]), split[1], split[0]))
    h.report(failures, "transfers in pieces train as whole ones")


if __name__ == "__main__":
    main()
