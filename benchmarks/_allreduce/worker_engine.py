"""The bare engine with neither TensorFlow nor the kungfu package: loads the library build_engine.sh compiled
from cc/ (its path is the plan's "library"), joins the cluster the driver describes in kfrun's variables
(KUNGFU_PEERS, KUNGFU_RANK, KUNGFU_TOKEN; the engine reads KUNGFU_TIMEOUT itself) and times the blocking
kungfu_all_reduce with the adapter worker_kungfu.py uses for its engine series. So the engine can be measured,
and compared with OpenMPI and the raw TCP ring, on a machine with only Python, numpy and a C++ compiler.

It then leaves the cluster as kungfu.finalize() does (engine_capi.finalize), so that a peer still in the last
collective does not take this exit for a failure. Exit status 1 when that leave was not clean."""
import os
import sys

import engine_capi
import harness


def _cluster():
    """(peers, rank) from the environment the driver (systems._engine) sets, checked."""
    peers = os.environ.get('KUNGFU_PEERS', '')
    rank = os.environ.get('KUNGFU_RANK', '')
    if not peers or not rank.isdigit():
        raise SystemExit('worker_engine.py: KUNGFU_PEERS and KUNGFU_RANK must be set (the allreduce driver sets '
                         'them); got %r and %r' % (peers, rank))
    size = len(peers.split(','))
    if int(rank) >= size:
        raise SystemExit('worker_engine.py: KUNGFU_RANK=%s but KUNGFU_PEERS lists %d peers' % (rank, size))
    return peers, int(rank)


def main():
    plan = harness.load_plan()
    peers, rank = _cluster()
    lib = engine_capi.load(plan['library'])
    engine_capi.init(lib, peers, rank, os.environ.get('KUNGFU_TOKEN', ''))
    coll = engine_capi.EngineCollective(lib, lib.kungfu_rank(), lib.kungfu_size())
    done = False
    try:
        series = harness.measure_series(coll, plan)
        harness.write_results(plan, coll.rank, {plan['series']: series})
        done = True
    finally:  # also on a failed measurement: stop the engine's threads, then let the exception through
        why = engine_capi.finalize(lib, clean=done)
    if why:
        print('worker_engine.py rank %d: left without the finalize barrier: %s' % (rank, why), file=sys.stderr,
              flush=True)
        sys.exit(1)


if __name__ == '__main__':
    main()
