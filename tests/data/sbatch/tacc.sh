#!/bin/bash

# Parameters
#SBATCH --account=ABC23456
#SBATCH --cpus-per-task=72
#SBATCH --error=/scratch/alice/geofed/runs/geofed/jobs/tacc-0/%j/%j_0_log.err
#SBATCH --job-name=geofed-geofed-tacc-0
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --open-mode=append
#SBATCH --output=/scratch/alice/geofed/runs/geofed/jobs/tacc-0/%j/%j_0_log.out
#SBATCH --partition=gh
#SBATCH --requeue
#SBATCH --signal=USR2@180
#SBATCH --time=2880
#SBATCH --wckey=submitit

# setup
module load gcc cuda
source $WORK/venvs/geofed/bin/activate

# command
export SUBMITIT_EXECUTOR=slurm
srun --unbuffered --output /scratch/alice/geofed/runs/geofed/jobs/tacc-0/%j/%j_%t_log.out --error /scratch/alice/geofed/runs/geofed/jobs/tacc-0/%j/%j_%t_log.err python -u -m submitit.core._submit /scratch/alice/geofed/runs/geofed/jobs/tacc-0/%j
