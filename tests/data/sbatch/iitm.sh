#!/bin/bash

# Parameters
#SBATCH --cpus-per-task=8
#SBATCH --error=/scratch/alice/geofed/runs/geofed/jobs/iitm-0/%j/%j_0_log.err
#SBATCH --gres=gpu:v100:2
#SBATCH --job-name=geofed-geofed-iitm-0
#SBATCH --mem=64GB
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=2
#SBATCH --open-mode=append
#SBATCH --output=/scratch/alice/geofed/runs/geofed/jobs/iitm-0/%j/%j_0_log.out
#SBATCH --partition=gpu
#SBATCH --qos=normal
#SBATCH --requeue
#SBATCH --signal=USR2@90
#SBATCH --time=1440
#SBATCH --wckey=submitit

# setup
module load anaconda3
eval "$(conda shell.bash hook)"
conda activate geofed
export https_proxy=http://proxy.example.iitm.ac.in:3128 http_proxy=http://proxy.example.iitm.ac.in:3128 grpc_proxy=http://proxy.example.iitm.ac.in:3128  # compute nodes reach out via this

# command
export SUBMITIT_EXECUTOR=slurm
srun --unbuffered --output /scratch/alice/geofed/runs/geofed/jobs/iitm-0/%j/%j_%t_log.out --error /scratch/alice/geofed/runs/geofed/jobs/iitm-0/%j/%j_%t_log.err python -u -m submitit.core._submit /scratch/alice/geofed/runs/geofed/jobs/iitm-0/%j
