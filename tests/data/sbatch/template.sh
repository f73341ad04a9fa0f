#!/bin/bash

# Parameters
#SBATCH --cpus-per-task=8
#SBATCH --error=/home/alice/geofed/runs/geofed/jobs/template-0/%j/%j_0_log.err
#SBATCH --gres=gpu:a100:1
#SBATCH --job-name=geofed-geofed-template-0
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --open-mode=append
#SBATCH --output=/home/alice/geofed/runs/geofed/jobs/template-0/%j/%j_0_log.out
#SBATCH --partition=gpu
#SBATCH --requeue
#SBATCH --signal=USR2@90
#SBATCH --time=240
#SBATCH --wckey=submitit

# setup
module load python
source $HOME/venvs/geofed/bin/activate

# command
export SUBMITIT_EXECUTOR=slurm
srun --unbuffered --output /home/alice/geofed/runs/geofed/jobs/template-0/%j/%j_%t_log.out --error /home/alice/geofed/runs/geofed/jobs/template-0/%j/%j_%t_log.err python -u -m submitit.core._submit /home/alice/geofed/runs/geofed/jobs/template-0/%j
