# Pinned: the same plan on every machine. Upgrade deliberately, then `terraform init -upgrade`.
terraform {
  required_version = ">= 1.5.0"

  required_providers {
    google = {
      source  = "hashicorp/google"
      version = "6.14.1"
    }
    google-beta = {
      source  = "hashicorp/google-beta"
      version = "6.14.1"
    }
  }
}

provider "google" {
  project = var.project
  region  = var.region
}

# Only for the Vertex AI service agent's identity (google_project_service_identity is beta-only).
provider "google-beta" {
  project = var.project
  region  = var.region
}
