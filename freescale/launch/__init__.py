"""Process orchestration that never runs in a rank: `freescale train`'s launcher (torchrun and its
ranks), `freescale compare`'s trainings, `freescale calibrate`'s run and its rank-speed ranks. It
starts the ranks by module name (``freescale.jobs...``); freescale.training is what runs in them.
"""
