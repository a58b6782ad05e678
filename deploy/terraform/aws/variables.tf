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
  # Checked at plan time, not after the nodes boot: every rank takes global_batch / ranks images.
  validation {
    condition     = var.global_batch == null ? true : var.global_batch % (var.node_count * var.gpus_per_node) == 0
    error_message = "global_batch ${coalesce(var.global_batch, 0)} does not divide over node_count x gpus_per_node = ${var.node_count} x ${var.gpus_per_node} = ${var.node_count * var.gpus_per_node} ranks: use node_count ${join(" or ", [for n in range(1, 17) : tostring(n) if coalesce(var.global_batch, 0) % (n * var.gpus_per_node) == 0])}, or a global_batch that ${var.node_count * var.gpus_per_node} divides."
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
  validation {
    condition     = var.gpus_per_node >= 1 && floor(var.gpus_per_node) == var.gpus_per_node
    error_message = "gpus_per_node must be a whole number of GPUs, 1 or more."
  }
}

variable "global_batch" {
  description = "images per optimizer step over all ranks, passed to the mode as --global-batch; null for a mode without that flag (comm)"
  type        = number
  default     = 2048
  nullable    = true
  validation {
    condition     = var.global_batch == null ? true : var.global_batch >= 1 && floor(var.global_batch) == var.global_batch
    error_message = "global_batch must be a whole number of images, 1 or more (or null for a mode without --global-batch)."
  }
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
  description = "arguments for the mode (the capstone's flags for imagenet); the global batch goes in global_batch"
  type        = string
  default     = "--model resnet50 --dataset imagefolder --data-root /shared/imagenet --amp bf16"
  validation {
    condition     = !can(regex("--global[-_]batch", var.run_args))
    error_message = "run_args names --global-batch: set it with -var global_batch=N instead, where plan checks it against node_count x gpus_per_node."
  }
}
