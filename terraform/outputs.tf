# Named as the config's keys (SECTION_KEY for SECTION.KEY): `moe-tpu init --from-terraform`
# writes each into a new config.

output "project" {
  description = "project"
  value       = var.project
}

output "region" {
  description = "region"
  value       = var.region
}

output "zones" {
  description = "zones"
  value       = var.zones
}

output "slice_network" {
  description = "slice.network"
  value       = google_compute_network.tpu.name
}

output "slice_subnetwork" {
  description = "slice.subnetwork"
  value       = google_compute_subnetwork.tpu.name
}

output "slice_service_account" {
  description = "slice.service_account"
  value       = google_service_account.trainer.email
}

output "vertex_service_account" {
  description = "vertex.service_account"
  value       = google_service_account.trainer.email
}

output "image_repository" {
  description = "image.repository (the trainer image in the Artifact Registry repository)"
  value       = "${google_artifact_registry_repository.images.location}-docker.pkg.dev/${var.project}/${google_artifact_registry_repository.images.repository_id}/trainer"
}

output "image_staging" {
  description = "image.staging (Cloud Build's source archives and logs; deleted after staging_retention_days)"
  value       = "gs://${google_storage_bucket.runs.name}/staging"
}

output "image_build_service_account" {
  description = "image.build_service_account"
  value       = google_service_account.builder.email
}

output "trainer_output_dir" {
  description = "trainer.output_dir: the runs' directory; `moe-tpu init --from-terraform` appends /RUN"
  value       = "gs://${google_storage_bucket.runs.name}/runs"
}
