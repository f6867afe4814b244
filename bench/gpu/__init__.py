"""Baton proven on a GPU: one prepared command (`scripts/gpu-proof.sh`) that starts `baton up`
with its trainers on the machine's GPU and a `file://` store on local disk, runs the proofs
below within a budget, writes `gpu.json` and `gpu.md`, and stops every process it started.

1. Exact resume (`resume.exact`): a GPT of about 100 M parameters (bf16 autocast, AdamW, a
   shuffling data loader with a worker, deterministic algorithms), its trainer SIGKILLed
   between two checkpoints and the run resumed by another trainer, bitwise equal to an
   uninterrupted run; once more with local snapshots.
2. The zygote and the GPU (`device.zygote`): a training process forked from the warm zygote
   initialises CUDA itself (the zygote holds no CUDA context), joins a one-rank group on
   the backend Baton picks (NCCL), and once its trainer is SIGKILLed the GPU memory it held
   is free again within a measured bound.
3. Checkpoint cost at size (`costs.cost`): a GPT of about 1 B parameters with AdamW's
   states: the snapshot's device-to-host copy against the pinned-copy limit measured in the
   same process, the training loop's stall per checkpoint, the write throughput to the store.
4. Overhead (`costs.overhead`): steps/s under Baton over the same loop run bare.
5. A framework (`resume.framework`): the Hugging Face Trainer (a Llama built from a config,
   bf16) killed after a checkpoint and resumed, bitwise equal to an uninterrupted run.

`--cpu --quick` runs the same code paths at tiny sizes on any machine (CI does); the ratio
goals are judged only on a GPU at full size, what must hold bitwise or by process is judged
everywhere. docs/gpu.md says what each proof checks and what one GPU cannot show.

    .venv/bin/python -m bench.gpu --out out/gpu [--cpu] [--quick] [--budget 540]
"""
