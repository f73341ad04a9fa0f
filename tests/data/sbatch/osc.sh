#!/bin/bash

# Parameters
#SBATCH --account=PAS0000
#SBATCH --cpus-per-task=24
#SBATCH --error=/fs/scratch/PAS0000/alice/geofed/runs/geofed/jobs/osc-0/%j/%j_0_log.err
#SBATCH --gpus-per-node=h100:4
#SBATCH --job-name=geofed-geofed-osc-0
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=4
#SBATCH --open-mode=append
#SBATCH --output=/fs/scratch/PAS0000/alice/geofed/runs/geofed/jobs/osc-0/%j/%j_0_log.out
#SBATCH --partition=gpu
#SBATCH --requeue
#SBATCH --signal=USR2@120
#SBATCH --time=720
#SBATCH --wckey=submitit

# setup
module load python/3.12
source $HOME/venvs/geofed/bin/activate

# command
export SUBMITIT_EXECUTOR=slurm
srun --unbuffered --output /fs/scratch/PAS0000/alice/geofed/runs/geofed/jobs/osc-0/%j/%j_%t_log.out --error /fs/scratch/PAS0000/alice/geofed/runs/geofed/jobs/osc-0/%j/%j_%t_log.err python -u -m submitit.core._submit /fs/scratch/PAS0000/alice/geofed/runs/geofed/jobs/osc-0/%j
