#!/bin/bash

# Parameters
#SBATCH --cpus-per-task=1
#SBATCH --error=/shared/runs/geofed/jobs/slurm_local-0/%j/%j_0_log.err
#SBATCH --job-name=geofed-geofed-slurm_local-0
#SBATCH --mem=1GB
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --open-mode=append
#SBATCH --output=/shared/runs/geofed/jobs/slurm_local-0/%j/%j_0_log.out
#SBATCH --partition=low
#SBATCH --requeue
#SBATCH --signal=USR2@90
#SBATCH --time=30
#SBATCH --wckey=submitit

# command
export SUBMITIT_EXECUTOR=slurm
srun --unbuffered --output /shared/runs/geofed/jobs/slurm_local-0/%j/%j_%t_log.out --error /shared/runs/geofed/jobs/slurm_local-0/%j/%j_%t_log.err python -u -m submitit.core._submit /shared/runs/geofed/jobs/slurm_local-0/%j
