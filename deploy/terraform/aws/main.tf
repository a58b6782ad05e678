# A small GPU cluster for the course on AWS: N instances in one cluster placement group and
# one subnet, an EFS file system mounted at /shared on every node (checkpoints and data), and
# a startup script that installs the course and starts ./entrypoint.sh with torchrun's c10d
# rendezvous at node 0. See README.md beside this file.
terraform {
  required_version = ">= 1.9" # validations that read other variables (node_count x gpus_per_node vs global_batch)
  required_providers {
    aws = {
      source  = "hashicorp/aws"
      version = ">= 5.0"
    }
  }
}

provider "aws" {
  region = var.region
}

# Ubuntu with the NVIDIA driver and CUDA (AWS Deep Learning Base AMI); the course's own
# pip install brings torch with its CUDA runtime.
data "aws_ami" "gpu" {
  most_recent = true
  owners      = ["amazon"]
  filter {
    name   = "name"
    values = ["Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 22.04)*"]
  }
}

data "aws_availability_zones" "available" {
  state = "available"
}

resource "aws_vpc" "cluster" {
  cidr_block           = "10.42.0.0/16"
  enable_dns_hostnames = true
  tags                 = { Name = "distlab" }
}

resource "aws_internet_gateway" "cluster" {
  vpc_id = aws_vpc.cluster.id
}

resource "aws_subnet" "cluster" {
  vpc_id                  = aws_vpc.cluster.id
  cidr_block              = "10.42.1.0/24"
  availability_zone       = data.aws_availability_zones.available.names[0]
  map_public_ip_on_launch = true
}

resource "aws_route_table" "cluster" {
  vpc_id = aws_vpc.cluster.id
  route {
    cidr_block = "0.0.0.0/0"
    gateway_id = aws_internet_gateway.cluster.id
  }
}

resource "aws_route_table_association" "cluster" {
  subnet_id      = aws_subnet.cluster.id
  route_table_id = aws_route_table.cluster.id
}

# Nodes talk to each other on every port (rendezvous, NCCL, gloo); from outside only ssh.
resource "aws_security_group" "nodes" {
  name   = "distlab-nodes"
  vpc_id = aws_vpc.cluster.id
  ingress {
    from_port = 0
    to_port   = 0
    protocol  = "-1"
    self      = true
  }
  ingress {
    from_port   = 22
    to_port     = 22
    protocol    = "tcp"
    cidr_blocks = [var.admin_cidr]
  }
  egress {
    from_port   = 0
    to_port     = 0
    protocol    = "-1"
    cidr_blocks = ["0.0.0.0/0"]
  }
}

# "cluster": instances close together on the network (low latency, full bisection bandwidth).
resource "aws_placement_group" "cluster" {
  name     = "distlab"
  strategy = "cluster"
}

resource "aws_efs_file_system" "shared" {
  creation_token = "distlab-shared"
  tags           = { Name = "distlab-shared" }
}

resource "aws_efs_mount_target" "shared" {
  file_system_id  = aws_efs_file_system.shared.id
  subnet_id       = aws_subnet.cluster.id
  security_groups = [aws_security_group.nodes.id]
}

locals {
  startup = {
    node_count    = var.node_count
    gpus_per_node = var.gpus_per_node
    efs_dns       = aws_efs_file_system.shared.dns_name
    repo_url      = var.repo_url
    repo_ref      = var.repo_ref
    run_mode      = var.run_mode
    run_args      = var.global_batch == null ? var.run_args : "${var.run_args} --global-batch ${var.global_batch}"
  }
}

# Node 0 first: the others need its private address for the rendezvous.
resource "aws_instance" "head" {
  ami                    = data.aws_ami.gpu.id
  instance_type          = var.instance_type
  key_name               = var.key_name
  subnet_id              = aws_subnet.cluster.id
  vpc_security_group_ids = [aws_security_group.nodes.id]
  placement_group        = aws_placement_group.cluster.id
  user_data = templatefile("${path.module}/startup.sh.tftpl",
  merge(local.startup, { node_rank = 0, master_addr = "" }))
  root_block_device {
    volume_size = 200
  }
  depends_on = [aws_efs_mount_target.shared]
  tags       = { Name = "distlab-node0" }
}

resource "aws_instance" "worker" {
  count                  = var.node_count - 1
  ami                    = data.aws_ami.gpu.id
  instance_type          = var.instance_type
  key_name               = var.key_name
  subnet_id              = aws_subnet.cluster.id
  vpc_security_group_ids = [aws_security_group.nodes.id]
  placement_group        = aws_placement_group.cluster.id
  user_data = templatefile("${path.module}/startup.sh.tftpl",
  merge(local.startup, { node_rank = count.index + 1, master_addr = aws_instance.head.private_ip }))
  root_block_device {
    volume_size = 200
  }
  depends_on = [aws_efs_mount_target.shared]
  tags       = { Name = "distlab-node${count.index + 1}" }
}
