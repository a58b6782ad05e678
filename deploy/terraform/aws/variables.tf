variable "region" {
  description = "AWS region; it must offer instance_type"
  type        = string
  default     = "us-east-1"
}

variable "node_count" {
  description = "GPU nodes; node 0 hosts torchrun's c10d rendezvous"
  type        = number
  default     = 2
  validation {
    condition     = var.node_count >= 1 && var.node_count <= 16
    error_message = "node_count must be between 1 and 16."
  }
}

variable "instance_type" {
  description = "GPU instance type (p4d.24xlarge: 8 x A100 40 GB with EFA; p5.48xlarge: 8 x H100)"
  type        = string
  default     = "p4d.24xlarge"
}

variable "gpus_per_node" {
  description = "GPUs per instance: torchrun starts one rank per GPU"
  type        = number
  default     = 8
}

variable "key_name" {
  description = "an existing EC2 key pair for ssh"
  type        = string
}

variable "admin_cidr" {
  description = "the address range allowed to ssh to the nodes (your IP/32)"
  type        = string
}

variable "repo_url" {
  description = "where the nodes clone the course from"
  type        = string
  default     = "https://github.com/your-org/distlab.git"
}

variable "repo_ref" {
  description = "branch, tag or commit to check out"
  type        = string
  default     = "main"
}

variable "run_mode" {
  description = "RUN_MODE of ./entrypoint.sh that every node starts"
  type        = string
  default     = "imagenet"
}

variable "run_args" {
  description = "arguments for the mode (the capstone's flags for imagenet)"
  type        = string
  default     = "--model resnet50 --dataset imagefolder --data-root /shared/imagenet --amp bf16 --global-batch 2048"
}
