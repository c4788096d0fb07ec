"""Operations helpers used in the container image and by the Ansible roles."""
