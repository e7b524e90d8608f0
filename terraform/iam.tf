# One identity for the trainer on TPU VMs and in Vertex AI jobs, one for Cloud Build. Every role
# on the bucket or the repository is granted on that resource alone; the project-level roles
# only write logs. No editor, no owner.

resource "google_service_account" "trainer" {
  account_id   = "${var.name}-trainer"
  display_name = "moe-tpu trainer (TPU VMs and Vertex AI jobs)"
  depends_on   = [google_project_service.apis]
}

resource "google_service_account" "builder" {
  account_id   = "${var.name}-builder"
  display_name = "moe-tpu image builds (Cloud Build)"
  depends_on   = [google_project_service.apis]
}

# The trainer reads and writes checkpoints, metrics and status in the bucket.
resource "google_storage_bucket_iam_member" "trainer_objects" {
  bucket = google_storage_bucket.runs.name
  role   = "roles/storage.objectUser"
  member = google_service_account.trainer.member
}

# TPU VMs pull the trainer image.
resource "google_artifact_registry_repository_iam_member" "trainer_pull" {
  location   = google_artifact_registry_repository.images.location
  repository = google_artifact_registry_repository.images.name
  role       = "roles/artifactregistry.reader"
  member     = google_service_account.trainer.member
}

resource "google_project_iam_member" "trainer_logs" {
  project = var.project
  role    = "roles/logging.logWriter"
  member  = google_service_account.trainer.member
}

# Vertex AI pulls a job's image as its service agent, not as the job's service account.
resource "google_project_service_identity" "vertex_agent" {
  provider = google-beta
  service  = "aiplatform.googleapis.com"
}

resource "google_artifact_registry_repository_iam_member" "vertex_pull" {
  location   = google_artifact_registry_repository.images.location
  repository = google_artifact_registry_repository.images.name
  role       = "roles/artifactregistry.reader"
  member     = "serviceAccount:${google_project_service_identity.vertex_agent.email}"
}

# Cloud Build reads the source archive, writes its log under staging/, and pushes the image.
resource "google_storage_bucket_iam_member" "builder_objects" {
  bucket = google_storage_bucket.runs.name
  role   = "roles/storage.objectUser"
  member = google_service_account.builder.member
}

resource "google_artifact_registry_repository_iam_member" "builder_push" {
  location   = google_artifact_registry_repository.images.location
  repository = google_artifact_registry_repository.images.name
  role       = "roles/artifactregistry.writer"
  member     = google_service_account.builder.member
}

resource "google_project_iam_member" "builder_logs" {
  project = var.project
  role    = "roles/logging.logWriter"
  member  = google_service_account.builder.member
}

# The people who run moe-tpu may start TPU VMs, Vertex AI jobs and builds as these accounts.
resource "google_service_account_iam_member" "operators_trainer" {
  for_each           = toset(var.operators)
  service_account_id = google_service_account.trainer.name
  role               = "roles/iam.serviceAccountUser"
  member             = each.value
}

resource "google_service_account_iam_member" "operators_builder" {
  for_each           = toset(var.operators)
  service_account_id = google_service_account.builder.name
  role               = "roles/iam.serviceAccountUser"
  member             = each.value
}
