variable "project" {
  description = "The Google Cloud project id."
  type        = string
}

variable "region" {
  description = "The region of the network, the bucket, the registry and the Vertex AI jobs (one that offers TPU v5e)."
  type        = string
  default     = "us-west4"
}

variable "zones" {
  description = "TPU v5e zones in the region, tried in order on stockout (the config's `zones`)."
  type        = list(string)
  default     = ["us-west4-a"]
}

variable "name" {
  description = "Prefix of every resource's name."
  type        = string
  default     = "moe-tpu"

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{2,18}[a-z0-9]$", var.name))
    error_message = "name must be 4 to 20 lowercase letters, digits or hyphens, starting with a letter."
  }
}

variable "bucket_name" {
  description = "The checkpoint and staging bucket (globally unique); empty: PROJECT-NAME."
  type        = string
  default     = ""
}

variable "subnet_cidr" {
  description = "The TPU workers' subnet."
  type        = string
  default     = "10.128.0.0/20"
}

variable "staging_retention_days" {
  description = "Objects under staging/ (image source archives, build logs) are deleted after this many days."
  type        = number
  default     = 14
}

variable "noncurrent_retention_days" {
  description = "Overwritten or deleted checkpoint objects stay recoverable this many days."
  type        = number
  default     = 7
}

variable "operators" {
  description = "Members who run moe-tpu (e.g. user:you@example.com): they may attach the trainer and builder service accounts."
  type        = list(string)
  default     = []
}

variable "labels" {
  description = "Labels on every resource that takes them."
  type        = map(string)
  default     = { managed-by = "moe-tpu" }
}
