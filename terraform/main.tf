locals {
  bucket_name = var.bucket_name != "" ? var.bucket_name : "${var.project}-${var.name}"
  services = toset([
    "tpu.googleapis.com",
    "aiplatform.googleapis.com",
    "artifactregistry.googleapis.com",
    "storage.googleapis.com",
    "cloudbuild.googleapis.com",
    "logging.googleapis.com",
    "compute.googleapis.com",
    "iam.googleapis.com",
  ])
}

data "google_project" "this" {}

# --- APIs --------------------------------------------------------------------------------------------

resource "google_project_service" "apis" {
  for_each           = local.services
  service            = each.value
  disable_on_destroy = false
}

# --- network: TPU workers talk to each other (ICI is on the chips; DCN and the JAX coordinator
# go over the VPC), and slices of a multislice job talk to each other over the same subnet ------------

resource "google_compute_network" "tpu" {
  name                    = "${var.name}-net"
  auto_create_subnetworks = false
  depends_on              = [google_project_service.apis]
}

resource "google_compute_subnetwork" "tpu" {
  name          = "${var.name}-${var.region}"
  network       = google_compute_network.tpu.id
  region        = var.region
  ip_cidr_range = var.subnet_cidr
  # Workers without external IPs still reach Artifact Registry and Cloud Storage.
  private_ip_google_access = true

  log_config {
    aggregation_interval = "INTERVAL_10_MIN"
    flow_sampling        = 0.1
    metadata             = "INCLUDE_ALL_METADATA"
  }
}

# Between the TPU VMs of one slice and between slices (multislice DCN traffic, the JAX
# coordinator, gRPC between hosts): every port, only from inside the subnet.
resource "google_compute_firewall" "internal" {
  name          = "${var.name}-internal"
  network       = google_compute_network.tpu.id
  direction     = "INGRESS"
  source_ranges = [var.subnet_cidr]

  allow {
    protocol = "tcp"
  }
  allow {
    protocol = "udp"
  }
  allow {
    protocol = "icmp"
  }

  log_config {
    metadata = "INCLUDE_ALL_METADATA"
  }
}

# SSH to the workers only through Identity-Aware Proxy (gcloud compute tpus tpu-vm ssh --tunnel-through-iap).
resource "google_compute_firewall" "iap_ssh" {
  name          = "${var.name}-iap-ssh"
  network       = google_compute_network.tpu.id
  direction     = "INGRESS"
  source_ranges = ["35.235.240.0/20"]

  allow {
    protocol = "tcp"
    ports    = ["22"]
  }

  log_config {
    metadata = "INCLUDE_ALL_METADATA"
  }
}

# --- the bucket: checkpoints under runs/, image source archives and build logs under staging/ ------------

resource "google_storage_bucket" "runs" {
  # checkov:skip=CKV_GCP_62:access logs would need a second bucket; Cloud Audit Logs already record who reads and writes
  name                        = local.bucket_name
  location                    = upper(var.region)
  storage_class               = "STANDARD"
  uniform_bucket_level_access = true
  public_access_prevention    = "enforced"
  force_destroy               = false
  labels                      = var.labels

  versioning {
    enabled = true
  }

  # Source archives and build logs are only needed while a build runs.
  lifecycle_rule {
    condition {
      age            = var.staging_retention_days
      matches_prefix = ["staging/"]
    }
    action {
      type = "Delete"
    }
  }

  # Versioning keeps what a run overwrote recoverable for a while, not forever.
  lifecycle_rule {
    condition {
      days_since_noncurrent_time = var.noncurrent_retention_days
      with_state                 = "ARCHIVED"
    }
    action {
      type = "Delete"
    }
  }

  depends_on = [google_project_service.apis]
}

# --- the registry ----------------------------------------------------------------------------------------

resource "google_artifact_registry_repository" "images" {
  # checkov:skip=CKV_GCP_84:Google-managed encryption; a customer-managed key would add Cloud KMS cost and a key to look after for public code and a trainer image
  location      = var.region
  repository_id = var.name
  description   = "moe-tpu trainer images (tags are content hashes)"
  format        = "DOCKER"
  labels        = var.labels

  cleanup_policies {
    id     = "keep-recent"
    action = "KEEP"
    most_recent_versions {
      keep_count = 10
    }
  }
  cleanup_policies {
    id     = "delete-old"
    action = "DELETE"
    condition {
      older_than = "2592000s" # 30 days, unless among the 10 most recent
    }
  }

  depends_on = [google_project_service.apis]
}
