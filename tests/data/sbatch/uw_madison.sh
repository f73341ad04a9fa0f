#!/bin/bash

# Parameters
#SBATCH --cpus-per-task=16
#SBATCH --error=/scratch/alice/geofed/runs/geofed/jobs/uw_madison-0/%j/%j_0_log.err
#SBATCH --gres=gpu:a100:2
#SBATCH --job-name=geofed-geofed-uw_madison-0
#SBATCH --mem=128GB
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=2
#SBATCH --open-mode=append
#SBATCH --output=/scratch/alice/geofed/runs/geofed/jobs/uw_madison-0/%j/%j_0_log.out
#SBATCH --partition=pre
#SBATCH --requeue
#SBATCH --signal=USR2@90
#SBATCH --time=1440
#SBATCH --wckey=submitit

# setup
eval "$(conda shell.bash hook)"
conda activate geofed

# command
export SUBMITIT_EXECUTOR=slurm
srun --unbuffered --output /scratch/alice/geofed/runs/geofed/jobs/uw_madison-0/%j/%j_%t_log.out --error /scratch/alice/geofed/runs/geofed/jobs/uw_madison-0/%j/%j_%t_log.err python -u -m submitit.core._submit /scratch/alice/geofed/runs/geofed/jobs/uw_madison-0/%j
