"""OpenMPI baseline: mpi4py Allreduce (sum) on float32 numpy buffers. Run under mpirun; the transport
(shared memory or TCP) is chosen by the driver's --mca flags, and the series name comes from the plan."""
import numpy as np
from mpi4py import MPI

import harness


class MpiCollective:
    def __init__(self, comm):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()

    def barrier(self):
        self.comm.Barrier()

    def sum_over_ranks(self, value):
        return self.comm.allreduce(int(value), op=MPI.SUM)

    def prepare(self, nbytes):
        x = np.ones(nbytes // 4, np.float32)
        y = np.empty_like(x)
        return (lambda: self.comm.Allreduce(x, y, op=MPI.SUM)), (lambda: float(y[0]))


def main():
    plan = harness.load_plan()
    coll = MpiCollective(MPI.COMM_WORLD)
    series = harness.measure_series(coll, plan)
    harness.write_results(plan, coll.rank, {plan['series']: series})


if __name__ == '__main__':
    main()
