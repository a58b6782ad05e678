output "head_private_ip" {
  description = "node 0: the rendezvous endpoint (port 29500) for every node"
  value       = aws_instance.head.private_ip
}

output "ssh" {
  description = "log in to a node; the run's log is /var/log/distlab.log"
  value       = concat(["ssh ubuntu@${aws_instance.head.public_ip}"], [for w in aws_instance.worker : "ssh ubuntu@${w.public_ip}"])
}

output "shared_file_system" {
  description = "the EFS file system mounted at /shared on every node"
  value       = aws_efs_file_system.shared.dns_name
}
